"""The traffic model (`varlen.comm.model.call_traffic`) against the bytes the groups count
(`return_stats=True`) on in-process ranks: every method and scheme, cp 1 to 8, forward and
backward, GQA heads that Ulysses replicates, sinks; usp under mpiexec in
tests/multiprocess/test_cp_usp.py (the worker compares every call)."""
import numpy as np
import pytest

import varlen
import varlen.comm as vc
from varlen.comm.model import call_traffic

from helpers import cases

LENGTHS = (0, 13, 7, 1, 22, 5, 0, 9)
HQ, HK, D, DV = 12, 2, 8, 4

COMBOS = cases([pytest.param(cp, method, scheme, u, id=f"cp{cp}-{method}{u or ''}-{scheme}")
                for cp in range(1, 9) for scheme in ("zigzag", "contiguous", "document")
                for method, u in (("ring", None), ("allgather", None), ("ulysses", None),
                                  ("usp", 2), ("usp", 3))
                if (method != "ulysses" or HQ % cp == 0) and (u is None or cp % u == 0)],
               lambda p: p.values[0] in (2, 3, 6) or p.values[0] == 8 and
               p.values[1] in ("ring", "usp"))


@pytest.mark.parametrize("cp, method, scheme, u", COMBOS)
def test_model_counts_what_the_groups_count(cp, method, scheme, u):
    rng = np.random.default_rng(cp)
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    T = int(cu[-1])
    q, dout = (rng.standard_normal((T, HQ, d)).astype(np.float32) for d in (D, DV))
    k, v = (rng.standard_normal((T, HK, d)).astype(np.float32) for d in (D, DV))
    part = vc.partition(cu, cp, scheme, **({"max_doc_len": 8} if scheme == "document" else {}))
    sinks = np.linspace(-1, 1, HQ).astype(np.float32)

    def body(group):
        r = group.rank
        sq, sk, sv, sd = (part.shard(x, r) for x in (q, k, v, dout))
        kw = dict(mask="causal", method=method, ulysses_size=u, sinks=sinks)
        out, lse, fwd = vc.attention_forward(sq, sk, sv, part, group, return_stats=True, **kw)
        bwd = vc.attention_backward(sd, sq, sk, sv, out, lse, part, group, return_stats=True,
                                    **kw)[-1]
        return fwd, bwd
    shape = dict(heads_q=HQ, heads_k=HK, head_dim=D, head_dim_v=DV, dtype="float32",
                 ulysses_size=u, sinks=True)
    for r, (fwd, bwd) in enumerate(vc.local_group(cp).run(body)):
        assert fwd == call_traffic(part, r, method, **shape), (r, fwd)
        assert bwd == call_traffic(part, r, method, backward=True, **shape), (r, bwd)
