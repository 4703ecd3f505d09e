"""Merging partial attention results through their log-sum-exp.

Attention over a key set split into disjoint parts A and B is the LSE-weighted mix of the
partial results (the "online softmax" rescaling of FlashAttention, one block at a time):

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

A part in which a query saw no key has `lse = -inf` and output 0. The weights are computed
against `m = max(lse_a, lse_b)` replaced by 0 where it is -inf, so `-inf - -inf` never occurs:
such a part gets weight 0, and a query that saw nothing anywhere keeps output 0 and lse -inf.
"""
from __future__ import annotations

import numpy as np

from varlen._array import array_module

__all__ = ["merge_partial", "accumulate_dtype"]


def accumulate_dtype(dtype):
    """float64 for float64 data, float32 otherwise (the merge and gradient accumulators)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Combine two partial results over disjoint key sets.

    Args:
        out_a, out_b: `[T, H, Dv]` partial outputs (each normalised over its own keys).
        lse_a, lse_b: `[H, T]` their natural-log sums of exp; `-inf` where a query saw no key.

    Returns `(out, lse)` in the accumulation dtype: float64 if any input is float64, else
    float32. Never NaN for -inf inputs. Working arrays (NumPy or CuPy) in, the same out.
    """
    xp = array_module(out_a)
    f64 = any(np.dtype(a.dtype) == np.float64 for a in (out_a, lse_a, out_b, lse_b))
    acc = np.float64 if f64 else np.float32
    la, lb = lse_a.astype(acc, copy=False), lse_b.astype(acc, copy=False)
    m = xp.maximum(la, lb)
    m = xp.where(xp.isfinite(m), m, acc(0))
    wa, wb = xp.exp(la - m), xp.exp(lb - m)                    # [H, T], 0 for a -inf part
    total = wa + wb
    seen = total > 0
    safe = xp.where(seen, total, acc(1))
    lse = xp.where(seen, m + xp.log(safe), acc(-np.inf))
    scale_a = (wa / safe).T[:, :, None]                        # [T, H, 1]
    scale_b = (wb / safe).T[:, :, None]
    out = out_a.astype(acc, copy=False) * scale_a + out_b.astype(acc, copy=False) * scale_b
    return out, lse
