"""Attention sinks on the Numba backend (the simulator on a CPU, the same test on a GPU): one
tiny batch with rows that see one key (a window), rows that see none (Lq > Lk bottom-right,
a sequence without keys), padding gaps, GQA, a head without a sink and a dominant one, against
the float64 reference, dsinks included, in both dQ modes."""
import numpy as np
import pytest

import varlen
from varlen import Mask

from helpers import check_against_reference, make_batch


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_sinks_match_reference(deterministic):
    rng = np.random.default_rng(11)
    mask = Mask(window_left=np.array([0, -1, 2], np.int32), window_right=0,
                bottom_right=np.array([False, True, True]))
    b = make_batch(rng, [5, 9, 3], [5, 4, 0], Hq=4, Hk=2, D=8, dtype="float32", mask=mask,
                   gaps=True)
    sinks = np.array([0.3, -np.inf, 6.0, -1.5], np.float32)
    kw = dict(**b.layout, backend="numba", sinks=sinks)
    out, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **kw)
    grads = varlen.attention_backward(b.dout, b.q, b.k, b.v, out, lse, b.cu_q, b.cu_k, **kw,
                                      deterministic=deterministic)
    check_against_reference(b, out, lse, grads, sinks=sinks, label=f"numba {deterministic}")
