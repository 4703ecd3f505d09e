"""The non-finite rules (docs/semantics.md, "Non-finite values"), in NumPy.

A row's results depend only on what it may see. The arithmetic therefore runs on inputs whose
non-finite values are replaced by 0 (a selection, so nothing of them leaks through a 0 x NaN
product into rows that cannot see them), and the rows a non-finite value *does* reach are set
to NaN afterwards:

* forward: query row i (head h) is NaN (out and lse) when q[i, h] holds a non-finite value or
  a key it sees holds one in k or v; a row that sees no key stays out 0, lse -inf;
* backward: a query-side value (q, dout, out, lse) reaches dq of its row and dk/dv of every key
  the row sees; a key-side value (k, v) reaches dk/dv of its key and dq of every query that
  sees it.

The reference and the NumPy backend both use these helpers; the kernels implement the same
rules with per-row flags.
"""
from __future__ import annotations

import numpy as np

__all__ = ["split_finite", "reached"]


def split_finite(g, ok=None):
    """`(values, bad)`: `g` (float64) with non-finite entries replaced by 0, and the bool flags
    `bad = any non-finite along the last axis`, False where `ok` (over the leading axes of
    `g`) is False."""
    finite = np.isfinite(g)
    bad = ~finite.all(axis=-1)
    if ok is not None:
        bad &= ok.reshape(ok.shape + (1,) * (bad.ndim - ok.ndim))
    if bad.any():
        g = np.where(finite, g, 0.0)
    return g, bad


def reached(allowed, own_bad, partner_bad):
    """Rows reached by a non-finite value: `own_bad [..., I]` where the row sees anything,
    or any partner `j` it sees with `partner_bad [..., J]`. `allowed [..., I, J]` is the
    visibility of the (row, partner) pairs; all three broadcast."""
    sees = allowed.any(axis=-1)
    return (own_bad & sees) | (allowed & partner_bad[..., None, :]).any(axis=-1)
