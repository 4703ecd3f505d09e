"""The `cpu` backend's numerics: the same bits from any calling thread."""
import concurrent.futures
import threading

import numpy as np
import pytest

import varlen

from helpers import fwd_bwd, make_batch

pytest.importorskip("numba")

from varlen.backends import _cpu_kernels as K  # noqa: E402
from varlen.backends import _cpu_threads  # noqa: E402


# --------------------------------------------------------------------------------------------
# The same bits from any calling thread
# --------------------------------------------------------------------------------------------

# GQA 8:1 over 90 rows: the dK/dV products' inner dimension (90 x 8 stacked query rows) is one
# that a multi-threaded OpenBLAS splits at other points than a single-threaded one.
THREAD_CASES = [
    ("B1-T90-gqa8-D64-full", [90], 8, 1, 64, "full"),
    ("B3-T517-gqa4-D97-causal", [17, 483, 17], 4, 1, 97, "causal"),
    ("B2-T300-gqa4-D64-sliding", [100, 200], 8, 2, 64,
     varlen.Mask(window_left=40, window_right=0)),
]


def _thread_batch(case):
    _, lengths, Hq, Hk, D, mask = case
    return make_batch(np.random.default_rng(len(lengths) * 1000 + D), lengths, Hq=Hq, Hk=Hk,
                      D=D, dtype="float32", mask=mask)


def _assert_same_bits(label, got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w), equal_nan=True), (
            f"{label}: {name} differs from the main thread's by up to "
            f"{np.nanmax(np.abs(np.asarray(g, float) - np.asarray(w, float))):.2e}")


def _call(b):
    out, lse, grads = fwd_bwd(b, backend="cpu")
    return (out, lse, *grads)


def test_blas_held_at_one_thread_in_a_call_from_any_thread():
    """Inside a call made from another thread than the one that first held BLAS, every BLAS
    library runs on one thread (threadpoolctl ignores the limits of any but its "controlling
    thread"), and the counts come back afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not (K.BLAS_BOUND and _cpu_threads.blas_controllable()):
        pytest.skip("no BLAS library to hold")
    blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
    before = [lib["num_threads"] for lib in blas.info()]
    with _cpu_threads.blas_scope(True):          # this thread holds them first
        pass
    seen = {}

    def other():
        with _cpu_threads.blas_scope(True) as usable:
            seen["usable"] = usable
            seen["inside"] = [lib["num_threads"] for lib in blas.info()]
        seen["after"] = [lib["num_threads"] for lib in blas.info()]

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["usable"]
    assert seen["inside"] == [1] * len(before), f"BLAS threads inside the call: {seen['inside']}"
    assert seen["after"] == before


@pytest.mark.parametrize("case", THREAD_CASES, ids=[c[0] for c in THREAD_CASES])
def test_bitwise_identical_from_other_threads(case):
    """Forward and backward called from a `threading.Thread` and from a thread pool (calls
    running concurrently) give the main thread's bits."""
    b = _thread_batch(case)
    want = _call(b)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("thread", _call(b)))
    t.start()
    t.join()
    _assert_same_bits(f"{case[0]} threading.Thread", got["thread"], want)
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        for n, result in enumerate(pool.map(lambda _: _call(b), range(6))):
            _assert_same_bits(f"{case[0]} pool call {n}", result, want)
    _assert_same_bits(f"{case[0]} main thread again", _call(b), want)


def test_torch_adapter_bitwise_identical_from_other_threads():
    """`varlen.torch.varlen_attention` on CPU tensors, forward and backward, from pool threads."""
    torch = pytest.importorskip("torch")
    import varlen.torch as vt
    b = _thread_batch(THREAD_CASES[0])
    cu = torch.from_numpy(b.cu_q)

    def call():
        q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in (b.q, b.k, b.v))
        out, lse = vt.varlen_attention(q, k, v, cu, cu, backend="cpu", return_lse=True)
        out.backward(torch.from_numpy(b.dout))
        return tuple(t.detach().numpy() for t in (out, lse, q.grad, k.grad, v.grad))

    want = call()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for n, result in enumerate(pool.map(lambda _: call(), range(4))):
            _assert_same_bits(f"torch pool call {n}", result, want)
