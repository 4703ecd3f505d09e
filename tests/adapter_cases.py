"""Cases shared by the PyTorch and JAX adapter tests: the same batches, built in NumPy for the
reference, with each mask built by an array constructor of the framework under test."""
import os

import numpy as np
import pytest

from varlen import Mask

from helpers import make_batch

# Each case: lengths_q, lengths_k, heads, dims, a mask builder taking an array constructor
# (so the reference gets NumPy fields and the adapter the framework's), and call keywords.
CASES = {
    "B3-T13-Hq4-Hk2-D16-causal_where": dict(
        lengths_q=[5, 1, 7], lengths_k=None, Hq=4, Hk=2, D=16, Dv=16, gaps=False,
        mask=lambda a: Mask.causal_where(a([True, False, True])), kw={}),
    "B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window": dict(
        lengths_q=[4, 0, 1, 6], lengths_k=[5, 0, 3, 6], Hq=4, Hk=1, D=8, Dv=8, gaps=True,
        mask=lambda a: Mask(window_left=a([2, -1, 0, 1]), window_right=a([0, -1, 1, -1]),
                            bottom_right=a([True, False, True, False])), kw={}),
    "B2-last-zero-Hq2-Hk2-D8-Dv12-causal_bottom_right-softcap": dict(
        lengths_q=[6, 0], lengths_k=[8, 0], Hq=2, Hk=2, D=8, Dv=12, gaps=False,
        mask=lambda a: "causal_bottom_right", kw=dict(softmax_scale=0.3, softcap=5.0)),
}

# A batch past int32: `[0, 3, 2**32 + 7, 2**32 + 12]` must never run as `[0, 3, 7, 12]`.
WIDE_CU = np.array([0, 3, 2**32 + 7, 2**32 + 12], np.int64)
WIDE_MESSAGE = r"cu_seqlens_q\[2\]=4294967303 is outside int32"


def np_array(x):
    return np.asarray(x, dtype=bool if isinstance(x[0], bool) else np.int32)


def build(case, dtype, seed=0):
    c = CASES[case]
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, c["lengths_q"], c["lengths_k"], Hq=c["Hq"], Hk=c["Hk"], D=c["D"],
                       Dv=c["Dv"], dtype=dtype, mask=c["mask"](np_array), gaps=c["gaps"])
    return batch, c


# `backend=` reaches the core: host arrays reach the Numba kernels only in the CUDA simulator.
needs_numba_simulator = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
    reason="host arrays reach the Numba kernels only in the CUDA simulator")


def numba_case():
    """A small batch with a per-sequence mask and a zero-length sequence, for `backend="numba"`."""
    batch = make_batch(np.random.default_rng(3), [3, 0, 4], Hq=2, Hk=1, D=8, dtype="float32",
                       mask=Mask.causal_where(np.array([True, False, False])))
    return batch, dict(mask=lambda a: Mask.causal_where(a([True, False, False])), kw={})


# Errors both adapters raise alike, whatever the framework: (change, exception, message).
SHARED_ERRORS = [
    pytest.param(dict(mask="diagonal"), ValueError, "not a known mask name", id="mask-name"),
    pytest.param(dict(deterministic="yes"), TypeError, "deterministic must be True or False",
                 id="deterministic-string"),
    pytest.param(dict(plan="plan"), TypeError, "plan must be a varlen.Plan", id="plan-type"),
    pytest.param(dict(mask=lambda: Mask(window_left=2.7)), TypeError,
                 r"mask.window_left must be an int", id="mask-window-float"),
]


def call_changed(attention, small, change):
    """`attention(q, k, v, cu, cu)` on the `small` arrays `(q, k, v, cu)` with `change`
    applied: the arrays it names replaced, the rest passed as keywords (a callable value is
    called first, so a bad Mask fails inside the test)."""
    q, k, v, cu = small
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    change = {n: x() if callable(x) else x for n, x in change.items()}
    args.update((n, x) for n, x in change.items() if n in args)
    return attention(*args.values(), **{n: x for n, x in change.items() if n not in args})
