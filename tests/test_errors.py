"""Bad input gets a ValueError/TypeError naming the argument; inputs are never modified."""
import contextvars
import threading

import numpy as np
import pytest

import varlen

CU = np.array([0, 3, 8], np.int32)
# Values past int32 in wider integer types must never run as their wrapped int32 values.
WIDE_CU = np.array([0, 3, 2**32 + 7, 2**32 + 12], np.int64)
WIDE_MESSAGE = r"cu_seqlens_q\[2\]=4294967303 is outside int32 \[-2\*\*31, .* 2147483647\]"


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
    ("mask-array-float", dict(mask=lambda: varlen.Mask(window_right=np.array([0.0, 1.0]))),
     TypeError, r"mask.window_right must be int32 or bool"),
    ("mask-window-float", dict(mask=lambda: varlen.Mask(window_left=2.7)), TypeError,
     r"mask.window_left must be an int \(or an int32/bool \[B\] array\), got 2.7"),
    ("mask-window-nan", dict(mask=lambda: varlen.Mask(window_left=float("nan"))), TypeError,
     r"mask.window_left must be an int .*got nan"),
    ("mask-bottom-right-2", dict(mask=lambda: varlen.Mask(bottom_right=2)), ValueError,
     r"mask.bottom_right must be True or False \(or 0/1\), got 2"),
    ("cu-int64-past-int32", dict(cu_q=WIDE_CU, cu_k=WIDE_CU), ValueError, WIDE_MESSAGE),
    ("cu-uint32-past-int32",
     dict(cu_q=np.array([0, 3, 2**31 + 7, 2**31 + 12], np.uint32), cu_k=WIDE_CU), ValueError,
     r"cu_seqlens_q\[2\]=2147483655 is outside int32"),
    ("offsets-int64-past-int32", dict(seq_offsets_k=np.array([0, 2**31, 2**31 + 5], np.int64)),
     ValueError, r"seq_offsets_k\[1\]=2147483648 is outside int32"),
    ("max-seqlen-past-int32", dict(max_seqlen_q=2**31), ValueError,
     r"max_seqlen_q=2147483648 is past the int32 limit"),
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
        # a callable builds its argument here: a bad Mask fails as it is made
        call(**{name: value() if callable(value) else value for name, value in kw.items()})


def test_backward_checks_its_extra_arguments():
    q, k, v = _qkv()
    out, lse = varlen.attention_forward(q, k, v, CU, CU)
    with pytest.raises(ValueError, match=r"dout has shape \(8, 4, 4\)"):
        varlen.attention_backward(out[..., :4], q, k, v, out, lse, CU, CU)
    with pytest.raises(ValueError, match=r"lse has shape \(8, 4\)"):
        varlen.attention_backward(out, q, k, v, out, lse.T, CU, CU)
    with pytest.raises(TypeError, match=r"out has dtype float16"):
        varlen.attention_backward(out, q, k, v, out.astype(np.float16), lse, CU, CU)
    with pytest.raises(TypeError, match=r"lse has dtype float64; expected float32, what "
                                        r"attention_forward returns for float32 inputs"):
        varlen.attention_backward(out, q, k, v, out, lse.astype(np.float64), CU, CU)
    with pytest.raises(TypeError, match=r"deterministic must be True or False, got 'yes'"):
        varlen.attention_backward(out, q, k, v, out, lse, CU, CU, deterministic="yes")


@pytest.mark.parametrize("validation", [None, False], ids=["default", "off"])
def test_dtype_checks_do_not_depend_on_validation(validation):
    """Types of equal byte size are told apart, and wide metadata is range-checked before
    its cast, with value validation off too (host metadata: the check reads host memory)."""
    import ml_dtypes
    q, k, v = _qkv(dtype=np.float16)
    with varlen.set_validation(validation):
        with pytest.raises(TypeError, match="share one dtype, got float16, bfloat16"):
            call(q, k.astype(ml_dtypes.bfloat16), v)
        out, lse = varlen.attention_forward(q, k, v, CU, CU)
        with pytest.raises(TypeError, match="dout has dtype bfloat16"):
            varlen.attention_backward(out.astype(ml_dtypes.bfloat16), q, k, v, out, lse, CU, CU)
        with pytest.raises(TypeError, match="lse has dtype int32"):
            varlen.attention_backward(out, q, k, v, out, lse.view(np.int32), CU, CU)
        wide = np.array([0, 3, 2**31 + 3], np.uint32)
        with pytest.raises(ValueError, match=r"cu_seqlens_k\[2\]=2147483651 is outside int32"):
            call(cu_k=wide)


@pytest.mark.gpu
def test_wide_device_metadata_is_flagged_without_a_host_read():
    """Device metadata past int32: validation off, device code flags it for
    check_device_errors(); validation on, the call reads it and refuses it."""
    cp = pytest.importorskip("cupy")
    q, k, v = (cp.asarray(x) for x in _qkv())
    wide = cp.asarray(np.array([0, 3, 2**32 + 8], np.int64))     # would wrap to [0, 3, 8]
    varlen.check_device_errors()
    varlen.attention_forward(q, k, v, wide, cp.asarray(CU))
    with pytest.raises(ValueError, match=r"cu_seqlens_q holds values outside int32"):
        varlen.check_device_errors()
    with varlen.set_validation(True):
        with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\]=4294967304 is outside int32"):
            varlen.attention_forward(q, k, v, wide, cp.asarray(CU))


def _out(mask):
    q, k, v = _qkv()
    cu = np.array([0, 3, 8], np.int32)
    return varlen.attention_forward(q, k, v, cu, np.array([0, 5, 8], np.int32), mask=mask)[0]


def test_mask_arrays_are_normalised_without_a_host_read():
    """Windows past int32 are unbounded (never wrapped to small ones); any nonzero bottom_right
    is True (never a doubled shift)."""
    unbounded = _out(varlen.Mask(window_left=np.array([-1, 2], np.int32)))
    wide = _out(varlen.Mask(window_left=np.array([2**32 - 1, 2], np.uint32)))
    wider = _out(varlen.Mask(window_left=np.array([2**40, 2], np.int64)))
    assert np.array_equal(wide, unbounded) and np.array_equal(wider, unbounded)
    br = dict(window_right=0)
    assert np.array_equal(_out(varlen.Mask(bottom_right=np.array([2, 0], np.int32), **br)),
                          _out(varlen.Mask(bottom_right=np.array([1, 0], np.int32), **br)))


def test_data_from_two_frameworks_is_refused():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k is a numpy array but q is a torch array"):
        call(torch.from_numpy(q), k, v)


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
