"""Property tests over random packed batches: the NumPy backend equals the float64 reference,
and the tile schedule is exact, for any lengths, gaps, heads, tiles and per-sequence policies."""
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import varlen

from helpers import CASES_SIZE, check_against_reference, fwd_bwd, make_batch
from test_plan import check_schedule_exact

# examples per run: 20 at the quick size, 60 with VARLEN_TEST_CASES=full; more locally:
# VARLEN_PROPERTY_EXAMPLES=600 python -m pytest tests/test_properties.py
EXAMPLES = int(os.environ.get("VARLEN_PROPERTY_EXAMPLES",
                              {"quick": "20", "full": "60"}[CASES_SIZE]))
window = st.sampled_from([-1, 0, 1, 2, 5, 9])


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    lq = draw(st.lists(st.integers(0, 24), min_size=B, max_size=B))
    cross = draw(st.booleans())
    lk = draw(st.lists(st.integers(0, 24), min_size=B, max_size=B)) if cross else lq
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2, 3]))
    per_seq = draw(st.booleans())
    if per_seq:
        mask = varlen.Mask(
            window_left=np.array(draw(st.lists(window, min_size=B, max_size=B)), np.int32),
            window_right=np.array(draw(st.lists(window, min_size=B, max_size=B)), np.int32),
            bottom_right=np.array(draw(st.lists(st.booleans(), min_size=B, max_size=B))))
    else:
        mask = draw(st.sampled_from(["full", "causal", "causal_bottom_right"]))
    seed = draw(st.integers(0, 2**31))
    b = make_batch(np.random.default_rng(seed), lq, lk, Hq=hq, Hk=hk, D=4, Dv=3, mask=mask,
                   gaps=draw(st.booleans()))
    blocks = (draw(st.sampled_from([1, 2, 3, 8])), draw(st.sampled_from([1, 4, 5, 16])))
    softcap = draw(st.sampled_from([0.0, 0.0, 3.0]))
    return b, blocks, softcap


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_numpy_backend_equals_reference(args):
    b, (bm, bn), softcap = args
    plan = varlen.plan(b.cu_q, b.cu_k, seq_offsets_q=b.off_q, seq_offsets_k=b.off_k,
                       mask=b.mask, num_rows_q=b.q.shape[0], num_rows_k=b.k.shape[0],
                       block_m=bm, block_n=bn)
    check_schedule_exact(plan)
    out, lse, grads = fwd_bwd(b, plan=plan, softcap=softcap)
    check_against_reference(b, out, lse, grads, softcap=softcap, label="property")
