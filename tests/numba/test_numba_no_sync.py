"""No host synchronisation on plan, forward and backward.

In the simulator, device arrays are `FakeCUDAArray`s wrapping NumPy. The test makes every way
the host could read one (copy to host, indexing, iteration, conversion, printing, comparisons)
raise when it happens outside a simulated CUDA thread, and forbids host-to-device copies too;
then it builds a plan from device `cu_seqlens`, offsets and per-sequence mask arrays, runs the
forward and both backward modes, then the forward and backward with dropout, and checks the
results afterwards. On a GPU the same guarantee is tested by capturing the whole step in a
CUDA graph (`test_numba_graph.py`).
"""
import contextlib
import threading

import numpy as np
import pytest

from varlen import Mask
from varlen.dropout import make_dropout
from varlen.backends.numba_backend import BACKEND as NUMBA, plan_from_cu_seqlens

from numba_testing import SIM
from helpers import check_against_reference, make_batch

pytestmark = pytest.mark.skipif(not SIM, reason="patches the simulator's device arrays")

# FakeCUDAArray members that read device data on the host (attribute names go through
# __getattr__ to the wrapped NumPy array).
_READ_METHODS = ("copy_to_host", "__getitem__", "__setitem__", "__str__", "__repr__",
                 "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__",
                 "__sub__", "__mul__", "__floordiv__", "__truediv__", "__mod__", "__pow__",
                 "split", "copy_to_device")
_READ_ATTRS = {"__array__", "__array_interface__", "__array_struct__", "__dlpack__", "tolist",
               "item", "tobytes", "get", "copy", "astype", "sum", "any", "all", "max", "min",
               "nonzero", "__iter__", "__bool__", "__int__", "__float__", "__index__"}


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_reads(monkeypatch):
    from numba import cuda
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    from numba.cuda.simulator.kernel import BlockThread
    seen = []

    def on_host():
        return not isinstance(threading.current_thread(), BlockThread)

    def guard(name, fn):
        def wrapped(self, *a, **kw):
            if on_host():
                seen.append(name)
                raise HostRead(f"host read of a device array: {name}")
            return fn(self, *a, **kw)
        return wrapped

    for name in _READ_METHODS:
        monkeypatch.setattr(FakeCUDAArray, name, guard(name, getattr(FakeCUDAArray, name)))
    getattr_orig = FakeCUDAArray.__getattr__

    def guarded_getattr(self, attr):
        if attr in _READ_ATTRS and on_host():
            seen.append(attr)
            raise HostRead(f"host read of a device array: .{attr}")
        return getattr_orig(self, attr)
    monkeypatch.setattr(FakeCUDAArray, "__getattr__", guarded_getattr)

    def no_h2d(*a, **kw):
        seen.append("to_device")
        raise HostRead("host-to-device copy inside the sync-free path")
    monkeypatch.setattr(cuda, "to_device", no_h2d)
    try:
        yield seen
    finally:
        monkeypatch.undo()


def test_guard_catches_reads(monkeypatch):
    from numba import cuda
    a = cuda.to_device(np.arange(4, dtype=np.int32))
    with forbid_host_reads(monkeypatch):
        for read in (lambda: a.copy_to_host(), lambda: a[1], lambda: np.asarray(a),
                     lambda: int(a[0]), lambda: list(a), lambda: a.tolist()):
            with pytest.raises((HostRead, TypeError)):
                read()
    assert a.copy_to_host()[3] == 3


def test_plan_forward_backward_without_host_reads(monkeypatch):
    from numba import cuda
    rng = np.random.default_rng(11)
    B = 5
    mask = Mask(window_left=np.array([-1, 2, -1, -1, 4], np.int32),
                window_right=np.array([0, 0, -1, 1, -1], np.int32),
                bottom_right=np.array([True, False, False, True, True]))
    batch = make_batch(rng, [0, 9, 1, 12, 0], [4, 9, 6, 12, 0], Hq=2, Hk=1, D=8,
                       dtype="float16", mask=mask, gaps=True)
    assert len(batch.cu_q) == B + 1
    d = {n: cuda.to_device(getattr(batch, n)) for n in ("q", "k", "v", "dout", "cu_q", "cu_k",
                                                        "off_q", "off_k")}
    dmask = Mask(*(cuda.to_device(f) for f in mask.fields()))
    Tq, Tk = batch.q.shape[0], batch.k.shape[0]
    kw = dict(softmax_scale=0.3, softcap=2.5)
    with forbid_host_reads(monkeypatch) as seen:
        plan = plan_from_cu_seqlens(d["cu_q"], d["cu_k"], seq_offsets_q=d["off_q"],
                                    seq_offsets_k=d["off_k"], mask=dmask, num_rows_q=Tq,
                                    num_rows_k=Tk, block_m=8, block_n=8)
        out, lse = NUMBA.forward(plan, d["q"], d["k"], d["v"], **kw)
        grads = NUMBA.backward(plan, d["dout"], d["q"], d["k"], d["v"], out, lse, **kw)
        grads_det = NUMBA.backward(plan, d["dout"], d["q"], d["k"], d["v"], out, lse, **kw,
                                   deterministic=True)
        # dropout: its seed, offset, threshold and scale are plain kernel arguments
        drop = make_dropout(0.25, 2**40 + 7, 3)
        out_d, lse_d = NUMBA.forward(plan, d["q"], d["k"], d["v"], **kw, dropout=drop)
        grads_d = NUMBA.backward(plan, d["dout"], d["q"], d["k"], d["v"], out_d, lse_d, **kw,
                                 dropout=drop)
    assert not seen, f"host reads: {seen}"
    for a in (out, lse, *grads, plan.q_tiles):
        assert type(a).__name__ == "FakeCUDAArray", f"{type(a).__name__} is not a device array"
    host = [a.copy_to_host() for a in (out, lse, *grads)]
    check_against_reference(batch, host[0], host[1], host[2:], softmax_scale=0.3, softcap=2.5,
                            label="sync-free")
    check_against_reference(batch, host[0], host[1], [g.copy_to_host() for g in grads_det],
                            softmax_scale=0.3, softcap=2.5, label="sync-free deterministic")
    check_against_reference(batch, out_d.copy_to_host(), lse_d.copy_to_host(),
                            [g.copy_to_host() for g in grads_d], softmax_scale=0.3, softcap=2.5,
                            dropout_p=0.25, seed=2**40 + 7, offset=3, label="sync-free dropout")
