"""Two-level context parallelism (`method="usp"`: Ulysses inside groups of `ulysses_size`
ranks, the ring across them) on in-process ranks: the cases of `comm_workers/usp_cp.py`
(sampled; every u dividing 4, 6 and 8 under mpiexec, torchrun and JAX's shard_map over a 2-D
mesh in tests/multiprocess/test_cp_usp.py) against the float64 reference; the subgroups split
once and kept; the bytes each call moves, per level; the arguments it refuses."""
import numpy as np
import pytest

import varlen.comm as vc

from comm_workers.usp_cp import SCHEMES, USP_CASES, check_usp, global_batch, partition
from helpers import cases, covering

COMBOS = cases([pytest.param(case, cp, u, scheme, id=f"cp{cp}-u{u}-{case.id}-{scheme}")
                for cp in (4, 6, 8) for u in (1, 2, 3, 4, cp) if cp % u == 0 and 12 % u == 0
                for case in USP_CASES for scheme in SCHEMES],
               covering(lambda p: (p.values[1], p.values[2]), lambda p: p.values[0].id,
                        lambda p: p.values[3]))


@pytest.mark.parametrize("case, cp, u, scheme", COMBOS)
def test_matches_single_process_reference(case, cp, u, scheme):
    vc.local_group(cp).run(check_usp, case, u, scheme)


def test_subgroups_are_split_once():
    case = USP_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 4, "zigzag")

    def body(group):
        q, k, v = (part.shard(g[x], group.rank) for x in "qkv")
        for _ in range(2):
            vc.attention_forward(q, k, v, part, group, mask="causal", method="usp",
                                 ulysses_size=2)
        splits = group.__dict__["_splits"]
        node = group.split([(0, 1), (2, 3)], level="intra")
        return len(splits), node.size, node.rank, node in splits.values()
    for r, (n, size, sub_rank, cached) in enumerate(vc.local_group(4).run(body)):
        assert (n, size, sub_rank, cached) == (2, 2, r % 2, True)


def test_ranks_that_split_differently_or_disagree_on_ulysses_size_all_raise():
    def split(group):
        groups = [(0, 1), (2, 3)] if group.rank else [(0, 2), (1, 3)]
        group.split(groups, level="intra")
    with pytest.raises(ValueError, match="ranks split the group differently"):
        vc.local_group(4).run(split)
    case = USP_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 4, "zigzag")

    def body(group):
        q, k, v = (part.shard(g[x], group.rank) for x in "qkv")
        vc.attention_forward(q, k, v, part, group, method="usp",
                             ulysses_size=2 if group.rank else 4)
    with pytest.raises(ValueError, match="disagree on ulysses_size"):
        vc.local_group(4).run(body)


def test_traffic_counts_what_each_collective_moves():
    def body(group):
        x = np.ones((3, 4), np.float32)                      # 48 bytes
        before = group.traffic.snapshot()
        group.allgather(x)                                  # 2 peers x 48
        group.alltoall(np.ones((3, 8), np.float64))         # 2 of 3 blocks of 64 bytes
        ch = group.p2p(5)
        ch.post_send(x, (group.rank + 1) % 3)
        buf = np.empty_like(x)
        ch.post_recv(buf, (group.rank - 1) % 3)
        ch.commit()
        ch.wait()
        sub = group.split([(0,), (1, 2)], level="intra")
        sub.allgather(x)
        return group.traffic.since(before), sub.level
    for r, (moved, level) in enumerate(vc.local_group(3).run(body)):
        assert moved["flat"] == {"sent": 96 + 128 + 48, "received": 96 + 128 + 48}
        assert level == "intra"
        assert moved.get("intra") == (None if r == 0 else {"sent": 48, "received": 48})


def test_bad_arguments_are_named():
    case = USP_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 4, "zigzag")

    def call(group, **kw):
        q, k, v = (part.shard(g[x], group.rank) for x in "qkv")
        vc.attention_forward(q, k, v, part, group, **kw)
    for kw, match in ((dict(method="usp"), "method='usp' needs ulysses_size"),
                      (dict(method="usp", ulysses_size=3), "does not divide cp_size=4"),
                      (dict(method="ring", ulysses_size=2), "ulysses_size=2 is for method='usp'"),
                      (dict(method="usp", ulysses_size=True), "needs ulysses_size")):
        with pytest.raises(ValueError, match=match):
            vc.local_group(4).run(call, **kw)
    part8 = partition(g["cu"], 8, "zigzag")

    def heads(group):
        q, k, v = (part8.shard(g[x], group.rank) for x in "qkv")
        vc.attention_forward(q[:, :10], k, v, part8, group, method="usp", ulysses_size=4)
    with pytest.raises(ValueError, match="q has 10 heads, not divisible"):
        vc.local_group(8).run(heads)


def test_jax_usp_needs_two_mesh_axes():
    jax = pytest.importorskip("jax")
    import varlen.jax as vj
    part = vc.partition(np.array([0, 8], np.int32), 2)
    q = jax.numpy.zeros((part.local_rows, 4, 8))
    with pytest.raises(ValueError, match=r"method='usp' needs axis_name=\(ring axis, Ulysses"):
        vj.context_parallel_attention(q, q, q, part, axis_name="cp", method="usp")
    with pytest.raises(ValueError, match="ulysses_size=2 is for method='usp'"):
        vj.context_parallel_attention(q, q, q, part, axis_name="cp", ulysses_size=2)
