"""Attention sinks under context parallelism on in-process ranks: the cases of
`comm_workers/sinks_cp.py` (sampled; all of them under mpiexec, torchrun and JAX's shard_map
in tests/multiprocess/test_cp_workers.py): every rank's shards of out, lse, dq, dk, dv and the
sinks' gradient (summed over the group, and each rank's share) against the float64 reference,
for ring, allgather and ulysses over zigzag and document partitions; the ranks must agree on
passing sinks."""
import numpy as np
import pytest

import varlen.comm as vc

from comm_workers.sinks_cp import SCHEMES, SINKS_CASES, check_sinks, global_batch, partition
from helpers import cases, covering

COMBOS = cases([pytest.param(case, cp, method, scheme,
                             id=f"cp{cp}-{case.id}-{scheme}-{method}")
                for cp in (2, 3, 4) for case in SINKS_CASES for scheme in SCHEMES
                for method in vc.METHODS if method != "ulysses" or case.Hq % cp == 0],
               covering(lambda p: p.values[0].id, lambda p: p.values[1],
                        lambda p: (p.values[2], p.values[3])))


@pytest.mark.parametrize("case, cp, method, scheme", COMBOS)
def test_matches_single_process_reference(case, cp, method, scheme):
    vc.local_group(cp).run(check_sinks, case, method, scheme)       # asserts on every rank


def test_ranks_must_agree_on_sinks():
    case = SINKS_CASES[0]
    g = global_batch(case)
    part = partition(g["cu"], 2, "zigzag")

    def body(group):
        q, k, v = (part.shard(g[x], group.rank) for x in "qkv")
        sinks = np.zeros(case.Hq) if group.rank == 0 else None
        vc.attention_forward(q, k, v, part, group, mask="causal", sinks=sinks)
    with pytest.raises(ValueError, match="disagree on sinks"):
        vc.local_group(2).run(body)
