"""CUDA-graph capture of plan + forward + backward, replayed with new `cu_seqlens` values.

Capture fails on any host synchronisation, host read or pageable copy, so this is the GPU
counterpart of `test_numba_no_sync.py`. The graph is captured once; each replay reads the
current contents of the captured input buffers (same shapes, new sequence lengths, mask and
data), and must give that batch's reference results.
"""
import numpy as np
import pytest

from varlen import Mask
from varlen.backends.numba_backend import BACKEND as NUMBA, plan_from_cu_seqlens

from helpers import GRAPH_BATCHES, GRAPH_MASKS, check_against_reference, make_batch

pytestmark = pytest.mark.gpu


def test_graph_replay_with_new_cu_seqlens():
    import cupy as cp
    rng = np.random.default_rng(5)
    batches = [make_batch(rng, lq, lk, Hq=4, Hk=2, D=64, dtype="float16",
                          mask=Mask(*m)) for (lq, lk), m in zip(GRAPH_BATCHES, GRAPH_MASKS)]
    first = batches[0]
    Tq, Tk = first.q.shape[0], first.k.shape[0]
    assert all(b.q.shape == first.q.shape and b.k.shape == first.k.shape for b in batches)
    names = ("q", "k", "v", "dout", "cu_q", "cu_k")
    buf = {n: cp.asarray(getattr(first, n)) for n in names}
    mbuf = [cp.asarray(f) for f in GRAPH_MASKS[0]]
    s = cp.cuda.Stream(non_blocking=True)
    kw = dict(softmax_scale=0.125, softcap=0.0)

    def step():
        plan = plan_from_cu_seqlens(buf["cu_q"], buf["cu_k"], num_rows_q=Tq, num_rows_k=Tk,
                                    mask=Mask(*mbuf), dtype="float16", head_dim=64)
        out, lse = NUMBA.forward(plan, buf["q"], buf["k"], buf["v"], **kw)
        grads = NUMBA.backward(plan, buf["dout"], buf["q"], buf["k"], buf["v"], out, lse, **kw)
        return plan, out, lse, grads

    with s:
        step()                       # compile and load every kernel outside the capture
    s.synchronize()
    with s:
        s.begin_capture()
        plan, out, lse, grads = step()
        graph = s.end_capture()
    for batch, m in zip(batches, GRAPH_MASKS):
        with s:
            for n in names:
                buf[n][...] = cp.asarray(getattr(batch, n))
            for dst, src in zip(mbuf, m):
                dst[...] = cp.asarray(src)
            graph.launch(stream=s)
        s.synchronize()
        check_against_reference(batch, out.get(), lse.get(), [g.get() for g in grads],
                                softmax_scale=0.125, label="graph replay")
