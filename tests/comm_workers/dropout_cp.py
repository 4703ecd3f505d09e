"""Attention dropout under context parallelism, checked on one rank of any group.

`check_dropout(group, case, method, scheme)` builds the same global batch on every rank, shards
it, runs `varlen.comm.attention_forward/backward` with the case's dropout (and mask, and sinks)
and compares this rank's shards of out, lse, dq, dk, dv (and dsinks) with the float64
reference's with the same seed (1e-12: the single-process call's, whose keep set
tests/test_dropout.py pins bitwise). `check_keep` reads the kept pairs off the output of a batch
built to show them (q = 0, v one-hot at each key's position) and compares them with
`varlen.reference.dropout_keep`. As a script, one rank of a job:

    mpiexec -n N python -m mpi4py tests/comm_workers/dropout_cp.py mpi   # every case, MPI group
    torchrun --nproc-per-node 2 tests/comm_workers/dropout_cp.py torch   # varlen.torch, gloo
    python tests/comm_workers/dropout_cp.py jax     # varlen.jax inside shard_map, 4 host devices
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

TOL = 1e-12                  # float64 data
SCHEMES = ("zigzag", "document")
# Every way a call names its method: the flat ones, usp with both levels where the group
# allows (u = 2 on 4 ranks; else u = cp) and the cost model's choice.
METHODS = ("ring", "allgather", "ulysses", "usp", "auto")
SEED = 0xDEAD_BEEF_0123_4567          # both 32-bit halves non-zero


@dataclass(frozen=True)
class DropoutCase:
    """A batch with lengths not divisible by 2*cp, zero-length and one-token documents, a
    causal sliding window (or a mask per sequence), GQA, and optionally sinks; `Hq = 12`
    divides by every cp and u the tests use, `Hk` does not always (Ulysses replicates KV
    heads)."""

    name: str
    lengths: tuple
    p: float = 0.3
    window: int | None = 4           # causal window; None: a mask per sequence
    sinks: bool = False
    backend: str = "numpy"
    Hq: int = 12
    Hk: int = 2
    D: int = 8
    seed: int = 0
    offset: int = 5

    @property
    def id(self):
        return self.name

    def mask(self):
        if self.window is not None:
            return varlen.Mask(window_left=self.window, window_right=0)
        B = len(self.lengths)
        left = np.array([-1, -1, 3, 0, 5, -1, 2, -1][:B], np.int32)
        right = np.array([0, -1, 0, 0, 1, 0, 0, -1][:B], np.int32)
        br = np.array([False, False, True, False, False, True, False, False][:B])
        return varlen.Mask(window_left=left, window_right=right, bottom_right=br)

    def sinks_values(self):
        if not self.sinks:
            return None
        s = np.random.default_rng(self.seed + 7).standard_normal(self.Hq) * 2.0
        s[-1] = -np.inf
        return s

    def dropout(self) -> dict:
        return dict(dropout_p=self.p, seed=SEED, offset=self.offset)


DROPOUT_CASES = [
    DropoutCase("window-gqa", (0, 13, 1, 7, 22, 9)),
    DropoutCase("masks+sinks-mqa-cpu", (11, 0, 30, 2, 6, 1), window=None, sinks=True, Hk=1,
                backend="cpu", seed=1, p=0.5),
]


def partition(cu, cp, scheme):
    if scheme == "document":
        return vc.partition(cu, cp, "document", max_doc_len=8)
    return vc.partition(cu, cp, scheme)


def method_args(method: str, cp: int) -> dict:
    """`method=` (and `ulysses_size=` for usp) of a call on `cp` ranks."""
    if method == "usp":
        return dict(method="usp", ulysses_size=2 if cp == 4 else cp)
    return dict(method=method)


def reference_results(case: DropoutCase, g: dict):
    kw = dict(mask=case.mask(), sinks=case.sinks_values(), **case.dropout())
    out, lse = reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], **kw)
    grads = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu"],
                                               g["cu"], **kw)
    return out, lse, grads


def check_dropout(group, case: DropoutCase, method: str, scheme: str) -> None:
    """One rank's check (asserts)."""
    r, cp = group.rank, group.size
    g = global_batch(case)
    part = partition(g["cu"], cp, scheme)
    sinks = case.sinks_values()
    kw = dict(mask=case.mask(), sinks=sinks, backend=case.backend, **method_args(method, cp),
              **case.dropout())
    q, k, v, dout = (part.shard(g[x], r) for x in ("q", "k", "v", "dout"))
    out, lse, fwd_bytes = vc.attention_forward(q, k, v, part, group, return_stats=True, **kw)
    *grads, bwd_bytes = vc.attention_backward(dout, q, k, v, out, lse, part, group,
                                              return_stats=True, **kw)
    # nothing of the keep set travels: the bytes are the traffic model's without dropout
    how = fwd_bytes.get("auto", {"method": kw["method"], "ulysses_size": kw.get("ulysses_size")})
    for what, moved in (("forward", fwd_bytes), ("backward", bwd_bytes)):
        moved = {n: b for n, b in moved.items() if n != "auto"}
        want = call_traffic(part, r, how["method"], heads_q=case.Hq, heads_k=case.Hk,
                            head_dim=case.D, dtype="float64", backward=what == "backward",
                            ulysses_size=how["ulysses_size"], sinks=sinks is not None)
        assert moved == want, f"{case.id} {method} {what} rank {r}: {moved} != model {want}"
    ref_out, ref_lse, ref_grads = reference_results(case, g)
    label = f"{case.id} cp={cp} {scheme} {method} rank {r}"
    check_rank_shards(label, part, r, out, lse, grads, ref_out, ref_lse, ref_grads, TOL)


def keep_batch(case: DropoutCase) -> dict:
    """A batch whose output shows the kept pairs: q = 0 (every visible key equally likely), v
    one-hot at each key's position in its document, so out[i, h, j] != 0 iff query i keeps
    key j at head h (and sees it)."""
    g = global_batch(case)
    L = max(case.lengths)
    g["q"][...] = 0
    g["v"] = np.zeros(g["k"].shape[:2] + (L,))
    for b, n in enumerate(case.lengths):
        g["v"][g["cu"][b] + np.arange(n), :, np.arange(n)] = 1
    return g


def check_keep(group, case: DropoutCase, method: str, scheme: str) -> None:
    """The pairs this rank's rows keep are `reference.dropout_keep`'s (asserts)."""
    r, cp = group.rank, group.size
    g = keep_batch(case)
    part = partition(g["cu"], cp, scheme)
    q, k, v = (part.shard(g[x], r) for x in "qkv")
    out, _ = vc.attention_forward(q, k, v, part, group, mask=case.mask(), backend=case.backend,
                                  **method_args(method, cp), **case.dropout())
    keep = reference.dropout_keep(g["cu"], g["cu"], case.Hq, case.p, SEED, case.offset)
    seen = reference.sequence_masks(g["cu"], g["cu"], case.mask())
    want = np.zeros(out.shape, bool)                          # [T_local, Hq, L]
    pos = np.asarray(part.positions(r))
    doc = part.shard(np.repeat(np.arange(len(case.lengths)), case.lengths), r)
    for t in np.flatnonzero(pos >= 0):
        b, i = doc[t], pos[t]
        want[t, :, :case.lengths[b]] = keep[b][:, i] & seen[b][i][None]
    got = out != 0
    bad = np.argwhere(got != want)
    assert not bad.size, (f"{case.id} cp={cp} {scheme} {method} rank {r}: rows x heads x keys "
                          f"{bad[:5].tolist()} kept otherwise than reference.dropout_keep")


def combos(cp: int):
    return [(case, method, scheme) for case in DROPOUT_CASES for scheme in SCHEMES
            for method in METHODS]


# --------------------------------------------------------------------------------------------
# PyTorch: varlen.torch.context_parallel_attention with dropout
# --------------------------------------------------------------------------------------------

def check_torch(case: DropoutCase, method: str, scheme: str, drawn: bool) -> None:
    """Outputs and gradients of `varlen.torch.context_parallel_attention` with dropout against
    the reference. `drawn`: seed=None, every rank's torch generator seeded differently: the
    ranks take rank 0's draw, the seed `varlen.torch.draw_seed()` gives after
    `torch.manual_seed(0)`."""
    import torch
    import torch.distributed as dist
    import varlen.torch as vt
    rank, cp = dist.get_rank(), dist.get_world_size()
    g = global_batch(case)
    part = partition(g["cu"], cp, scheme)
    kw = case.dropout()
    if drawn:
        torch.manual_seed(0)
        kw["seed"] = vt.draw_seed()                     # what rank 0 draws below
        torch.manual_seed(0 if rank == 0 else 1000 + rank)
    sinks = case.sinks_values()
    t_sinks = None if sinks is None else torch.tensor(sinks, requires_grad=True)
    q, k, v = (torch.tensor(part.shard(g[x], rank), requires_grad=True) for x in "qkv")
    out = vt.context_parallel_attention(q, k, v, part, mask=case.mask(), sinks=t_sinks,
                                        **method_args(method, cp),
                                        **(dict(kw, seed=None) if drawn else kw))
    (out * torch.as_tensor(part.shard(g["dout"], rank))).sum().backward()
    ref_kw = dict(mask=case.mask(), sinks=sinks, **kw)
    ref_out, _ = reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], **ref_kw)
    ref_grads = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu"],
                                                   g["cu"], **ref_kw)
    label = f"torch {case.id} cp={cp} {scheme} {method} drawn={drawn} rank {rank}"
    check_torch_shards(label, part, rank, out, (q, k, v), t_sinks, ref_out, ref_grads, TOL)


# --------------------------------------------------------------------------------------------
# JAX: varlen.jax.context_parallel_attention inside shard_map, a replicated dropout_rng
# --------------------------------------------------------------------------------------------

def check_jax(case: DropoutCase, cp: int, method: str, scheme: str) -> None:
    """Outputs and gradients of the concatenated shards under `jax.jit(jax.grad(...))` against
    the float64 reference with the seed the key's words give (`varlen.dropout.seed_of_words`
    of `jax.random.bits(key, (2,), uint32)`), a key replicated over the mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.jax as vj
    from varlen.dropout import seed_of_words

    g = global_batch(case)
    part = partition(g["cu"], cp, scheme)
    sinks = case.sinks_values()
    key = jax.random.key(case.seed + 42)
    seed = seed_of_words(np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
    if method == "usp":
        mesh = Mesh(np.array(jax.devices()[:cp]).reshape(cp // 2, 2), ("ring", "node"))
        axis, rows = ("ring", "node"), P(("ring", "node"))
    else:
        mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
        axis, rows = "cp", P("cp")

    def sharded(x):
        return jnp.concatenate([part.shard(x, r) for r in range(cp)])

    def loss(q, k, v, rng):
        def body(q, k, v, rng):
            return vj.context_parallel_attention(
                q, k, v, part, axis_name=axis, mask=case.mask(), method=method,
                sinks=None if sinks is None else jnp.asarray(sinks), dropout_p=case.p,
                dropout_rng=rng, offset=case.offset)
        f = jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 3 + (P(),), out_specs=rows)
        out = f(q, k, v, rng)
        return jnp.sum(out * sharded(g["dout"])), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, out = grad(*(sharded(g[x]) for x in "qkv"), key)
    kw = dict(mask=case.mask(), sinks=sinks, dropout_p=case.p, seed=seed, offset=case.offset)
    ref_out, _ = reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], **kw)
    ref_grads = reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"], g["cu"],
                                                   g["cu"], **kw)
    label = f"jax {case.id} cp={cp} {scheme} {method}"
    _assert_close(f"{label} out", out, sharded(ref_out), TOL)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(f"{label} {name}", got, sharded(want), TOL)


def check_jax_bad_input() -> None:
    """No dropout_rng, a dropout_rng that differs per device, a dropout_p out of range: each a
    clear error while tracing."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import varlen.jax as vj

    case = DROPOUT_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 2, "zigzag")
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    q, k, v = (jnp.concatenate([part.shard(g[x], r) for r in range(2)]) for x in "qkv")

    def run(rng_of, **kw):
        def body(q, k, v, rng):
            return vj.context_parallel_attention(q, k, v, part, axis_name="cp",
                                                 dropout_rng=rng_of(rng), **kw)
        return jax.shard_map(body, mesh=mesh, in_specs=(P("cp"),) * 3 + (P(),),
                             out_specs=P("cp"))(q, k, v, jax.random.key(0))

    def fold(rng):                                      # a different key on every device
        return jax.random.fold_in(rng, jax.lax.axis_index("cp"))
    for rng_of, kw, error, says in (
            (lambda r: None, dict(dropout_p=0.1), ValueError, "dropout_rng is required"),
            (fold, dict(dropout_p=0.1), ValueError, "dropout_rng varies over the mesh axes"),
            (lambda r: r, dict(dropout_p=1.0), ValueError, "dropout_p must be in"),
            (lambda r: r, dict(dropout_p=0.1, offset=-1), ValueError, "offset must be")):
        try:
            run(rng_of, **kw)
        except error as e:
            assert says in str(e), f"{kw}: {e}"
        else:
            raise AssertionError(f"{kw} did not raise {error.__name__}")


JAX_CHECKS = ((2, 0, "ring", "document"), (4, 0, "ulysses", "zigzag"),
              (4, 1, "usp", "zigzag"), (2, 1, "allgather", "document"))


def _jax_main():
    jax_main([partial(check_jax, DROPOUT_CASES[i], cp, method, scheme)
              for cp, i, method, scheme in JAX_CHECKS] + [check_jax_bad_input])


def _torch_main():
    torch_main([partial(check_torch, case, method, scheme, drawn)
                for case, method, scheme, drawn in (
                    (DROPOUT_CASES[0], "ring", "zigzag", True),
                    (DROPOUT_CASES[0], "ulysses", "document", False),
                    (DROPOUT_CASES[1], "allgather", "document", True))])


if __name__ == "__main__":
    {"mpi": partial(mpi_main, "dropout", combos, check_dropout), "torch": _torch_main,
     "jax": _jax_main}[sys.argv[1]]()
