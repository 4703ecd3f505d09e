"""Bad input gets a ValueError/TypeError naming the argument; inputs are never modified."""
import contextvars
import threading

import numpy as np
import pytest

import varlen

CU = np.array([0, 3, 8], np.int32)


def _qkv(Tq=8, Tk=8, Hq=4, Hk=2, D=8, Dv=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((Tq, Hq, D)).astype(dtype),
            rng.standard_normal((Tk, Hk, D)).astype(dtype),
            rng.standard_normal((Tk, Hk, Dv)).astype(dtype))


def call(q=None, k=None, v=None, cu_q=CU, cu_k=CU, **kw):
    dq, dk, dv = _qkv()
    return varlen.attention_forward(dq if q is None else q, dk if k is None else k,
                                    dv if v is None else v, cu_q, cu_k, **kw)


BAD = [
    ("cu-nonzero-start", dict(cu_q=np.array([1, 3, 8], np.int32)), ValueError,
     r"cu_seqlens_q\[0\] is 1"),
    ("cu-non-monotone", dict(cu_k=np.array([0, 5, 3], np.int32)), ValueError,
     r"cu_seqlens_k must be non-decreasing"),
    ("cu-past-buffer", dict(cu_q=np.array([0, 3, 9], np.int32)), ValueError,
     r"cu_seqlens_q\[-1\]=9 exceeds the 8 rows of q"),
    ("cu-float", dict(cu_q=np.array([0.0, 3.0, 8.0])), TypeError,
     r"cu_seqlens_q must hold integers"),
    ("cu-2d", dict(cu_q=CU.reshape(1, 3)), ValueError, r"cu_seqlens_q must be a 1-D"),
    ("cu-batch-differs", dict(cu_k=np.array([0, 8], np.int32)), ValueError,
     r"cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    ("cu-empty", dict(cu_q=np.zeros(0, np.int32), cu_k=np.zeros(0, np.int32)), ValueError,
     r"cu_seqlens_q is empty"),
    ("heads-not-divisible", dict(k=_qkv(Hk=3)[1], v=_qkv(Hk=3)[2]), ValueError,
     r"q has 4 heads and k has 3"),
    ("head-dim-differs", dict(k=_qkv(D=16)[1]), ValueError, r"disagree on head dim"),
    ("kv-rows-differ", dict(v=_qkv(Tk=9)[2]), ValueError, r"disagree on rows"),
    ("kv-heads-differ", dict(v=_qkv(Hk=1)[2]), ValueError, r"disagree on heads"),
    ("dtypes-differ", dict(k=_qkv(dtype=np.float16)[1]), TypeError, r"share one dtype"),
    ("int-dtype", dict(q=np.zeros((8, 4, 8), np.int32)), TypeError, r"q has dtype int32"),
    ("rank-2", dict(q=np.zeros((8, 32), np.float32)), ValueError, r"q must be 3-D"),
    ("offsets-too-tight", dict(seq_offsets_q=np.array([0, 2, 8], np.int32)), ValueError,
     r"seq_offsets_q is too tight: sequence 0 has 3 rows"),
    ("offsets-past-buffer", dict(seq_offsets_k=np.array([0, 3, 9], np.int32)), ValueError,
     r"seq_offsets_k\[-1\]=9 exceeds"),
    ("offsets-wrong-length", dict(seq_offsets_q=np.array([0, 3], np.int32)), ValueError,
     r"seq_offsets_q has 2 entries; expected 3"),
    ("mask-array-wrong-length",
     dict(mask=varlen.Mask(window_left=np.array([1, 2, 3], np.int32))), ValueError,
     r"mask.window_left has shape \(3,\); expected a scalar or \[2\]"),
    ("mask-array-float", dict(mask=varlen.Mask(window_right=np.array([0.0, 1.0]))), TypeError,
     r"mask.window_right must be int32 or bool"),
    ("mask-unknown-name", dict(mask="causal_top_left"), ValueError,
     r"mask='causal_top_left' is not a known mask name"),
    ("mask-wrong-type", dict(mask=1), TypeError, r"mask must be a mask name"),
    ("max-seqlen-too-small", dict(max_seqlen_q=4), ValueError,
     r"sequence 1 has 5 rows but max_seqlen_q=4"),
    ("max-seqlen-not-int", dict(max_seqlen_k=4.5), TypeError, r"max_seqlen_k must be"),
    ("unknown-backend", dict(backend="triton"), ValueError, r"backend='triton' is not a known"),
    ("negative-softcap", dict(softcap=-1.0), ValueError, r"softcap must be"),
    ("nan-scale", dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite"),
    ("not-an-array", dict(q="abc"), TypeError, r"q must be an array"),
]


@pytest.mark.parametrize("kw,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(kw, exc, match):
    with pytest.raises(exc, match=match):
        call(**kw)


def test_backward_checks_its_extra_arguments():
    q, k, v = _qkv()
    out, lse = varlen.attention_forward(q, k, v, CU, CU)
    with pytest.raises(ValueError, match=r"dout has shape \(8, 4, 4\)"):
        varlen.attention_backward(out[..., :4], q, k, v, out, lse, CU, CU)
    with pytest.raises(ValueError, match=r"lse has shape \(8, 4\)"):
        varlen.attention_backward(out, q, k, v, out, lse.T, CU, CU)
    with pytest.raises(TypeError, match=r"out has dtype float16"):
        varlen.attention_backward(out, q, k, v, out.astype(np.float16), lse, CU, CU)


def test_validation_can_be_switched_off_and_on():
    bad = np.array([0, 5, 3], np.int32)
    old = varlen.set_validation(False)
    try:
        # unchecked values never touch memory outside the buffers: rows are clamped
        out, _ = call(cu_k=bad)
        assert out.shape == (8, 4, 8)
    finally:
        varlen.set_validation(old)
    with pytest.raises(ValueError):
        call(cu_k=bad)
    with pytest.raises(TypeError, match="set_validation expects"):
        varlen.set_validation("yes")


def test_set_validation_is_a_context_manager_and_a_plain_call():
    bad = np.array([0, 5, 3], np.int32)
    with varlen.set_validation(False) as previous:
        assert previous == None  # noqa: E711 (it compares equal to the mode it replaced)
        assert call(cu_k=bad)[0].shape == (8, 4, 8)
        with varlen.set_validation(True):
            with pytest.raises(ValueError):
                call(cu_k=bad)
        assert call(cu_k=bad)[0].shape == (8, 4, 8)
    with pytest.raises(ValueError):
        call(cu_k=bad)
    old = varlen.set_validation(True)
    assert old == None and varlen.set_validation(old) == True  # noqa: E711, E712


def test_validation_mode_belongs_to_the_thread():
    """While another thread has validation off, this thread's bad call is still refused."""
    switched, done = threading.Event(), threading.Event()

    def other():
        with varlen.set_validation(False):
            switched.set()
            done.wait(10)
    t = threading.Thread(target=other)
    t.start()
    try:
        assert switched.wait(10)
        with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
            call(cu_k=np.array([0, 5, 3], np.int32))
    finally:
        done.set()
        t.join()


def test_validation_mode_belongs_to_the_context():
    def off():
        varlen.set_validation(False)
        return call(cu_k=np.array([0, 5, 3], np.int32))[0].shape
    assert contextvars.copy_context().run(off) == (8, 4, 8)
    with pytest.raises(ValueError):
        call(cu_k=np.array([0, 5, 3], np.int32))


def test_error_messages_do_not_modify_inputs():
    q, k, v = _qkv()
    cu = CU.copy()
    snapshot = [x.copy() for x in (q, k, v, cu)]
    with pytest.raises(ValueError):
        varlen.attention_forward(q, k, v, cu, cu, max_seqlen_q=1)
    for a, b in zip(snapshot, (q, k, v, cu)):
        assert np.array_equal(a, b)
