"""The device mask predicate agrees with `varlen.masks`, its Python statement.

`visible`, `key_band` and `query_band` of `_numba_kernels` are evaluated by a kernel over
sampled positions and policies (unbounded and zero windows, both alignments, Lq != Lk,
positions outside [0, L)) and compared with the NumPy forms element by element.
"""
import numpy as np

from numba import cuda   # a module global: the simulator swaps it inside kernels

from varlen import masks
from varlen.backends import _numba_kernels as K

from numba_testing import SIM

N = 600 if SIM else 20000


@cuda.jit
def _evaluate(i, j, left, right, shift, vis, kband, qband):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for n in range(start, i.shape[0], step):
        pol = (left[n], right[n], shift[n])
        vis[n] = K.visible(i[n], j[n], pol)
        kband[n, 0], kband[n, 1] = K.key_band(i[n], pol)
        qband[n, 0], qband[n, 1] = K.query_band(j[n], pol)


def test_device_predicate_matches_masks_module():
    rng = np.random.default_rng(3)
    i, j = rng.integers(-3, 14, size=(2, N))
    left, right = rng.choice([-1, 0, 1, 4], size=(2, N))
    lq, lk = rng.integers(0, 12, size=(2, N))
    br = rng.integers(0, 2, size=N)
    shift = (lk - lq) * br
    vis = np.zeros(N, np.bool_)
    kband = np.zeros((N, 2), np.int64)
    qband = np.zeros((N, 2), np.int64)
    _evaluate[2, 32](i, j, left, right, shift, vis, kband, qband)
    want = masks.visible(i, j, lq, lk, left, right, br)
    bad = np.flatnonzero(vis != want)
    assert bad.size == 0, f"visible differs at i={i[bad[:3]]}, j={j[bad[:3]]}"
    for name, got, band in (("key_band", kband, masks.key_band(np, i, shift, left, right)),
                            ("query_band", qband, masks.query_band(np, j, shift, left, right))):
        for edge, col in (("lo", 0), ("hi", 1)):
            bad = np.flatnonzero(got[:, col] != band[col])
            assert bad.size == 0, f"{name} {edge} differs at rows {bad[:3]}"
    # The bands are the predicate: j in key_band(i) iff i in query_band(j) iff visible.
    in_k = (kband[:, 0] <= j) & (j <= kband[:, 1])
    in_q = (qband[:, 0] <= i) & (i <= qband[:, 1])
    assert np.array_equal(in_k, want) and np.array_equal(in_q, want), "bands disagree"
