"""Deterministic aux gradients on the device: sums in 64-bit fixed point (docs/mods.md).

The gradient of a score_mod's float aux entry is a sum of float32 contributions `g` (one per
visible pair and head that reads the entry) that the backward kernels add in no fixed order.
Float additions do not associate; integer additions do. So with `deterministic=True` each
contribution is added to the entry's `WORDS` uint64 words with integer atomics, and one
conversion at the end turns them into float32 (`to_float32`, array code on the device; the
Numba kernels' own `_numba_kernels.aux_fixed_kernel`). Per entry, `[e, word]`:

    POS_HI  sum over g > 0 of floor(|g| 2^24)                          (units of 2^-24)
    POS_LO  sum over g > 0 of round((|g| 2^24 - floor(|g| 2^24)) 2^24)  (units of 2^-48)
    NEG_HI, NEG_LO   the same over g < 0
    FLAGS   or of NAN (a NaN g), POS_INF, NEG_INF (an infinite g), RANGE (below)

Every word only grows, so the sum is exact and the same in any order, and a word that would
pass `LIMIT` = 2^63 is caught by the addition that crosses it, whichever it is (`RANGE`).
Resolution: each contribution is rounded to a multiple of 2^-48 (about 3.6e-15; a `|g|` below
2^-49 adds nothing), so an entry of n contributions is within n 2^-49 of their exact sum before
its one rounding to float32. Range: the contributions of one sign sum to less than 2^39 (about
5.5e11) in magnitude, and an entry takes fewer than 2^39 contributions of one sign (each adds
at most 2^24 to its LO word). A single `|g| >= 2^39` or a word past `LIMIT` sets `RANGE`: the
entry's result is NaN and `varlen.check_device_errors()` raises `RANGE_ERROR` (an
OverflowError), never a wrapped value. The result follows docs/semantics.md: NaN if a NaN was
added or if both infinities were; +inf or -inf if only that one was; else the fixed-point sum.

The kernels: `kernels_cuda/aux_fixed.cuh` (`fixed_add`, CuPy) and `_numba_kernels.fixed_add`.
"""
from __future__ import annotations

import numpy as np

WORDS = 5
POS_HI, POS_LO, NEG_HI, NEG_LO, FLAGS = range(WORDS)
HI_BITS = 24                          # POS_HI/NEG_HI count units of 2^-HI_BITS
LO_BITS = 48                          # POS_LO/NEG_LO count units of 2^-LO_BITS
LIMIT = 1 << 63                       # no word reaches it; the crossing addition flags RANGE
NAN, POS_INF, NEG_INF, RANGE = 1, 2, 4, 8

RANGE_ERROR = ("a score_mod's aux gradient left the range of the deterministic fixed-point "
               "sums (per entry, contributions of one sign summing to 2^39 or more, or 2^39 "
               "contributions of one sign); that entry is NaN")


def buffer(xp, size: int):
    """The zeroed words of an aux array of `size` entries: uint64 `[size, WORDS]`."""
    return xp.zeros((size, WORDS), xp.uint64)


def to_float32(xp, words):
    """`(grad, out_of_range)`: float32 `[n]` sums of the words `[n, WORDS]` and a 0-d bool,
    whether an entry set RANGE; device array code of `xp` (no host read)."""
    w = words.reshape(-1, WORDS)
    # each word < 2^63: exact as int64, and so is the difference
    s = w.view(xp.int64)
    hi = (s[:, POS_HI] - s[:, NEG_HI]).astype(xp.float64)
    lo = (s[:, POS_LO] - s[:, NEG_LO]).astype(xp.float64)
    value = hi * 2.0 ** -HI_BITS + lo * 2.0 ** -LO_BITS
    flags = w[:, FLAGS]

    def has(bits):
        return (flags & xp.uint64(bits)) != 0
    pos, neg = has(POS_INF), has(NEG_INF)
    value = xp.where(pos, np.inf, xp.where(neg, -np.inf, value))
    value = xp.where(has(NAN | RANGE) | (pos & neg), np.nan, value)
    return value.astype(xp.float32), has(RANGE).any()
