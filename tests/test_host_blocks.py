"""`varlen._array.HostBlocks`: host memory of returned arrays, reused only once every array
that reaches it is gone."""
import gc

import numpy as np
import pytest

import varlen
from varlen._array import HostBlocks, alloc, bfloat16_dtype, host_blocks, set_nan_fill

from helpers import make_batch

MIB = 1 << 20


def _address(a) -> int:
    return a.__array_interface__["data"][0]


def test_block_reused_only_after_every_view_is_gone():
    pool = HostBlocks(min_bytes=MIB)
    a = pool.empty((512, 1024), np.float32)
    where = _address(a)
    views = [a[::2], a.T, a.reshape(-1)[7:], a.view(np.uint32), np.asarray(a)]
    del a
    gc.collect()
    assert pool.free_bytes() == 0
    b = pool.empty((512, 1024), np.float32)
    assert _address(b) != where                    # the first block is still reachable
    for v in views[:-1]:
        del views[0]
        gc.collect()
        assert pool.free_bytes() == 0
    del views[0], v
    gc.collect()
    assert pool.free_bytes() == 2 * MIB
    c = pool.empty((2 * MIB,), np.uint8)
    assert _address(c) == where
    assert pool.free_bytes() == 0


def test_exported_arrays_keep_their_block():
    torch = pytest.importorskip("torch")
    pool = HostBlocks(min_bytes=MIB)
    a = pool.empty((MIB // 4,), np.float32)
    a[:] = 3.0
    t = torch.from_numpy(a)
    d = torch.utils.dlpack.from_dlpack(a)
    del a
    gc.collect()
    assert pool.free_bytes() == 0
    fresh = pool.empty((MIB // 4,), np.float32)
    fresh[:] = -1.0
    assert float(t.min()) == 3.0 and float(d.max()) == 3.0
    del t, d
    gc.collect()
    assert pool.free_bytes() == MIB


def test_limits_and_small_arrays():
    pool = HostBlocks(min_bytes=MIB, keep=1, limit=3 * MIB)
    small = pool.empty((10,), np.float32)
    assert small.flags.owndata                      # below min_bytes: a plain array
    arrays = [pool.empty((MIB,), np.uint8) for _ in range(3)]
    arrays += [pool.empty((2 * MIB,), np.uint8)]
    del arrays
    gc.collect()
    assert pool.free_bytes() == 3 * MIB             # one per size kept
    pool.clear()
    assert pool.free_bytes() == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_alloc_cached_fills_like_alloc(dtype):
    dt = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    if dt is None:
        pytest.skip("ml_dtypes is not installed")
    old = set_nan_fill(True)
    try:
        nan = alloc(np, (MIB,), dt, cached=True)
        assert nan.dtype == dt and nan.shape == (MIB,)
        assert np.isnan(nan.astype(np.float32)).all()
        del nan
        gc.collect()
        zero = alloc(np, (MIB,), dt, cached=True, fill=0)   # the NaN block again
        assert (zero.astype(np.float32) == 0).all()
        ninf = alloc(np, (MIB,), dt, cached=True, fill=-np.inf)
        assert (ninf.astype(np.float32) == -np.inf).all()
    finally:
        set_nan_fill(old)


def test_held_outputs_are_never_overwritten():
    """A caller that keeps one call's outputs while the next call runs keeps its values; an
    output the caller dropped lends its memory to the next call (pages already mapped)."""
    rng = np.random.default_rng(0)
    b = make_batch(rng, [3000, 17, 900], Hq=4, Hk=2, D=64, dtype="float32", mask="causal")
    host_blocks.clear()
    first, lse = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                          backend="numpy")
    keep = first.copy(), lse.copy()
    other = make_batch(rng, [3000, 17, 900], Hq=4, Hk=2, D=64, dtype="float32", mask="causal")
    second, _ = varlen.attention_forward(other.q, other.k, other.v, other.cu_q, other.cu_k,
                                         **other.layout, backend="numpy")
    assert np.array_equal(first, keep[0]) and np.array_equal(lse, keep[1])
    assert _address(second) != _address(first)
    where = _address(first)
    del first, lse
    gc.collect()
    third, _ = varlen.attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, **b.layout,
                                        backend="numpy")
    assert _address(third) == where
    assert np.array_equal(third, keep[0])
