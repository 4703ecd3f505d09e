"""Shared test helpers: adversarial packed batches and dtype-aware comparisons (from
`varlen.testing`), and a forward-and-backward call through the public API.

Tolerances follow STYLE.md: a backend's error against the float64 reference must be within a
small factor (2x output, 3x gradients) of a naive same-dtype computation's error, plus a
rounding floor; a relative-RMS check is paired with a max-abs check, so one unwritten (NaN or
zero) row cannot hide.
"""
from __future__ import annotations

import varlen
from varlen.testing import (EPS, FLOOR_UNIT, Batch, assert_close, assert_lse,  # noqa: F401
                            check_against_reference, covered_rows, make_batch, naive_same_dtype,
                            np_dtype)


def fwd_bwd(batch: Batch, backend="numpy", **kw):
    out, lse = varlen.attention_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k,
                                        **batch.layout, backend=backend, **kw)
    grads = varlen.attention_backward(batch.dout, batch.q, batch.k, batch.v, out, lse,
                                      batch.cu_q, batch.cu_k, **batch.layout, backend=backend,
                                      **kw)
    return out, lse, grads
