"""The Philox 4x32-10 round and key schedule as plain functions on uint32 words, compiled by
every kernel that draws dropout bits: `numba.njit` in the `cpu` backend's kernels and
`numba.cuda.jit(device=True)` in the Numba CUDA kernels (the simulator runs them as Python).

The rule they implement is `varlen.dropout.philox4x32_10` (docs/semantics.md, "Dropout"); the
constants are that module's. Only NumPy scalar arithmetic, so all three targets compile it:
each 32 x 32 -> 64-bit product is formed in uint64 and split into its high and low words.

The `cpu` backend's kernels are cached on disk (`cache=True`), and Numba keys that cache on
their own file only: `_cpu_kernels.PHILOX_SOURCE_SHA256` names this file's digest, and a test
fails until an edit here is recorded there (which also invalidates that cache).
"""
from __future__ import annotations

import numpy as np

from ..dropout import PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, SEQ_MIX

__all__ = ["philox_round", "philox_bump", "philox_sequence_key"]

_MASK32 = 0xFFFFFFFF


def philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox 4x32 round on uint32 words `(c0, c1, c2, c3)` under round key `(k0, k1)`."""
    p0 = np.uint64(c0) * np.uint64(PHILOX_M0)
    p1 = np.uint64(c2) * np.uint64(PHILOX_M1)
    return (np.uint32(p1 >> np.uint64(32)) ^ np.uint32(c1) ^ np.uint32(k0), np.uint32(p1),
            np.uint32(p0 >> np.uint64(32)) ^ np.uint32(c3) ^ np.uint32(k1), np.uint32(p0))


def philox_bump(k0, k1):
    """The key schedule: round r + 1's key from round r's, `(k0 + W0, k1 + W1) mod 2^32`."""
    return (np.uint32((np.uint64(k0) + np.uint64(PHILOX_W0)) & np.uint64(_MASK32)),
            np.uint32((np.uint64(k1) + np.uint64(PHILOX_W1)) & np.uint64(_MASK32)))


def philox_sequence_key(seed_hi, b):
    """The second key word of sequence `b`: `seed_hi ^ (b * SEQ_MIX mod 2^32)`."""
    return np.uint32(seed_hi) ^ np.uint32((np.uint64(b) * np.uint64(SEQ_MIX)) &
                                          np.uint64(_MASK32))
