"""Shared bits of the Numba suite: where kernels run, the context-parallel shard layout."""
import numpy as np
from numba import config as _numba_config

from varlen.plan import Segments

# True in the CUDA simulator: tiny shapes there (one OS thread per CUDA thread, about a
# millisecond per thread per launch); False on a GPU.
SIM = bool(getattr(_numba_config, "ENABLE_CUDASIM", 0))


def two_segments(rng, L, cp=2):
    """Zigzag-like shard segments: chunks r and 2cp-1-r of every (padded) sequence."""
    B = len(L)
    r = int(rng.integers(0, cp))
    chunk = -(-L // (2 * cp))
    row = np.zeros((B, 2), np.int64)
    length = np.zeros((B, 2), np.int64)
    pos = np.zeros((B, 2), np.int64)
    at = 0
    for b in range(B):
        for s, c in enumerate((r, 2 * cp - 1 - r)):
            pos[b, s] = c * chunk[b]
            length[b, s] = max(0, min(chunk[b], L[b] - pos[b, s]))
            row[b, s] = at
            at += chunk[b]
    return Segments(row.astype(np.int32), length.astype(np.int32), pos.astype(np.int32),
                    L.astype(np.int32), int(at))
