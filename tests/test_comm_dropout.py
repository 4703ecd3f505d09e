"""Attention dropout under context parallelism on in-process ranks: the cases of
`comm_workers/dropout_cp.py` (sampled; all of them under mpiexec, torchrun and JAX's shard_map
in tests/multiprocess/test_cp_workers.py): every rank's shards of out, lse, dq, dk, dv (and
dsinks) equal the single-process result with the same seed, for ring, allgather, ulysses, usp
and method="auto" over zigzag and document partitions on 2, 3 and 4 ranks; the kept pairs are
`reference.dropout_keep`'s; the kernels draw at the global query head; the torch adapter's
drawn seed is rank 0's; bad input."""
import threading

import numpy as np
import pytest

import varlen
import varlen.comm as vc
from varlen.dropout import make_dropout

from comm_workers.dropout_cp import (DROPOUT_CASES, METHODS, SCHEMES, SEED, check_dropout,
                                     check_keep, global_batch, partition)
from helpers import cases, covering

# Quick: every method and scheme on 2 and 3 ranks for the first case (NumPy backend), the
# other case and 4 ranks (usp over both levels) sampled.
_cover = covering(lambda p: p.values[0].id, lambda p: p.values[1],
                  lambda p: (p.values[0].id, p.values[2], p.values[3]))
COMBOS = cases([pytest.param(case, cp, method, scheme,
                             id=f"cp{cp}-{case.id}-{scheme}-{method}")
                for cp in (2, 3, 4) for case in DROPOUT_CASES for scheme in SCHEMES
                for method in METHODS],
               lambda p: _cover(p) or (p.values[0] is DROPOUT_CASES[0] and p.values[1] < 4))


_COMPILED = {"numpy"}          # the backends whose kernels this process has run


def _group(case, cp):
    """The case's in-process ranks. The first group of a backend that compiles on first use (the
    `cpu` backend's Numba kernels: about 30 s on a loaded machine with a cold cache) gets the
    time for it, which the usual bound on every wait (60 s) would not leave."""
    if case.backend in _COMPILED:
        return vc.local_group(cp)
    _COMPILED.add(case.backend)
    return vc.local_group(cp, timeout=600.0)


@pytest.mark.parametrize("case, cp, method, scheme", COMBOS)
def test_matches_single_process_with_the_same_seed(case, cp, method, scheme):
    _group(case, cp).run(check_dropout, case, method, scheme)       # asserts on every rank


KEEP = [pytest.param(DROPOUT_CASES[0], 3, "ulysses", "zigzag", id="cp3-ulysses-zigzag"),
        pytest.param(DROPOUT_CASES[1], 4, "usp", "document", id="cp4-usp-document-cpu"),
        pytest.param(DROPOUT_CASES[1], 2, "ring", "document", id="cp2-ring-document-cpu")]


@pytest.mark.parametrize("case, cp, method, scheme", KEEP)
def test_keep_set_is_the_reference(case, cp, method, scheme):
    _group(case, cp).run(check_keep, case, method, scheme)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_kernels_draw_at_the_global_head(backend):
    """A kernel call whose local head 0 is global head 5 (`Dropout.head_offset`) keeps the
    pairs the whole call keeps at heads 5 and 6."""
    from varlen import backends
    lengths = [9, 0, 14]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(cu[-1])
    q = np.zeros((T, 2, 4))
    k = np.random.default_rng(0).standard_normal((T, 1, 4))
    v = np.zeros((T, 1, max(lengths)))
    for b, n in enumerate(lengths):
        v[cu[b] + np.arange(n), :, np.arange(n)] = 1
    plan = varlen.plan(cu, cu, backend=backend)
    d = make_dropout(0.4, SEED, 2).for_heads(5)
    out, _ = backends.get(backend).forward(plan, q, k, v, softmax_scale=0.5, softcap=0.0,
                                           dropout=d)
    keep = varlen.reference.dropout_keep(cu, cu, 7, 0.4, SEED, 2)
    for b, n in enumerate(lengths):
        got = out[cu[b]:cu[b + 1], :, :n].transpose(1, 0, 2) != 0
        assert np.array_equal(got, keep[b][5:7]), f"{backend}: sequence {b}"


def _forward_body(case, cp, **kw):
    g = global_batch(case)
    part = partition(g["cu"], cp, "zigzag")

    def body(group):
        q, k, v = (part.shard(g[x], group.rank) for x in "qkv")
        return vc.attention_forward(q, k, v, part, group, mask="causal", **kw)
    return body


BAD = [(dict(dropout_p=1.0, seed=1), ValueError, "dropout_p must be in"),
       (dict(dropout_p=float("nan"), seed=1), ValueError, "dropout_p must be in"),
       (dict(dropout_p=-0.1, seed=1), ValueError, "dropout_p must be in"),
       (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p must be a float"),
       (dict(dropout_p=0.1), ValueError, "seed is required"),
       (dict(dropout_p=0.1, seed=1.5), TypeError, "seed must be an int"),
       (dict(dropout_p=0.1, seed=2 ** 64), ValueError, "seed must be an int"),
       (dict(dropout_p=0.1, seed=1, offset=-1), ValueError, "offset must be an int")]


@pytest.mark.parametrize("kw, error, says", BAD, ids=[b[2].split()[0] + f"-{i}"
                                                      for i, b in enumerate(BAD)])
def test_bad_input_raises_on_every_rank(kw, error, says):
    with pytest.raises(error, match=says):
        vc.local_group(2).run(_forward_body(DROPOUT_CASES[0], 2, **kw))


@pytest.mark.parametrize("mine, theirs", [(dict(seed=1), dict(seed=2)),
                                          (dict(seed=1), dict(seed=1, offset=1)),
                                          (dict(seed=1), dict(dropout_p=0.0))])
def test_ranks_must_agree_on_dropout(mine, theirs):
    case = DROPOUT_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 2, "zigzag")

    def body(group):
        q, k, v = (part.shard(g[x], group.rank) for x in "qkv")
        kw = {"dropout_p": 0.2, **(theirs if group.rank else mine)}
        vc.attention_forward(q, k, v, part, group, mask="causal", **kw)
    with pytest.raises(ValueError, match=r"disagree on dropout \(dropout_p, seed, offset\)"):
        vc.local_group(2).run(body)


def test_step_plans_pick_a_backend_that_runs_dropout():
    case = DROPOUT_CASES[0]
    part = partition(global_batch(case)["cu"], 2, "zigzag")
    steps = vc.plan(part, 0, dtype="float64", head_dim=case.D, dropout_p=0.1)
    assert varlen.backends.get(steps.backend).runs_dropout
    with pytest.raises(ValueError, match="dropout_p must be in"):
        vc.plan(part, 0, dtype="float64", head_dim=case.D, dropout_p=1.5)


# --------------------------------------------------------------------------------------------
# varlen.torch.context_parallel_attention
# --------------------------------------------------------------------------------------------

def test_torch_drawn_seed_is_rank_0s(monkeypatch):
    """seed=None: every rank draws (here each a different seed) and all take rank 0's; the
    shards are the reference's with that seed, forward and backward."""
    torch = pytest.importorskip("torch")
    import varlen._torch_ops as ops
    import varlen.torch as vt
    case = DROPOUT_CASES[0]
    g = global_batch(case)
    cp = 3
    part = partition(g["cu"], cp, "document")
    ranks = {}
    monkeypatch.setattr(ops, "draw_seed", lambda: 1000 + 77 * ranks[threading.get_ident()])
    kw = dict(mask=case.mask(), dropout_p=case.p, offset=case.offset)
    ref = varlen.reference.attention_dense(g["q"], g["k"], g["v"], g["cu"], g["cu"], seed=1000,
                                           **kw)[0]
    ref_dq = varlen.reference.attention_dense_backward(g["dout"], g["q"], g["k"], g["v"],
                                                       g["cu"], g["cu"], seed=1000, **kw)[0]

    def body(group):
        ranks[threading.get_ident()] = group.rank
        q, k, v = (torch.tensor(part.shard(g[x], group.rank), requires_grad=x == "q")
                   for x in "qkv")
        out = vt.context_parallel_attention(q, k, v, part, group, method="ulysses", **kw)
        (out * torch.as_tensor(part.shard(g["dout"], group.rank))).sum().backward()
        return out.detach().numpy(), q.grad.numpy()
    res = vc.local_group(cp).run(body)
    for i, (name, want) in enumerate((("out", ref), ("dq", ref_dq))):
        got = part.unshard([r[i] for r in res])
        assert np.abs(got - want).max() < 1e-12, f"{name} is not the reference with rank 0's seed"


def test_torch_bad_input():
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    case = DROPOUT_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 2, "zigzag")

    def run(**kw):
        def body(group):
            q, k, v = (torch.tensor(part.shard(g[x], group.rank)) for x in "qkv")
            vt.context_parallel_attention(q, k, v, part, group, **kw)
        vc.local_group(2).run(body)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        run(dropout_p=1.0)
    with pytest.raises(ValueError, match="seed is required .* deterministic=True"):
        run(dropout_p=0.1, deterministic=True)
    with pytest.raises(TypeError, match="seed must be an int"):
        run(dropout_p=0.1, seed="7")
