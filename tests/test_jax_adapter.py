"""`varlen.jax.varlen_attention`: the custom VJP against the float64 reference, eagerly and
under `jax.jit(jax.grad(...))`, through both callback paths on the CPU."""
import importlib.util
import pathlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import varlen  # noqa: E402
import varlen.jax as vj  # noqa: E402
from varlen import Mask  # noqa: E402

from adapter_cases import (CASES, SHARED_ERRORS, WIDE_CU, WIDE_MESSAGE,  # noqa: E402
                           build, call_changed, needs_numba_simulator, np_array,
                           numba_case)
from helpers import check_against_reference, covered_rows, make_batch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def jnp_array(x):
    return jnp.asarray(np_array(x))


def _opt(x):
    return None if x is None else jnp.asarray(x)


def inputs(batch):
    return (jnp.asarray(batch.q), jnp.asarray(batch.k), jnp.asarray(batch.v),
            jnp.asarray(batch.cu_q), jnp.asarray(batch.cu_k), _opt(batch.off_q),
            _opt(batch.off_k), jnp.asarray(batch.dout))


def attention_fn(case, **extra):
    """`(q, k, v, metadata...) -> (out, lse)`, every array an argument (traced under jit)."""
    def fn(q, k, v, cu_q, cu_k, off_q, off_k):
        return vj.varlen_attention(q, k, v, cu_q, cu_k, seq_offsets_q=off_q,
                                   seq_offsets_k=off_k, mask=case["mask"](jnp_array),
                                   return_lse=True, **case["kw"], **extra)
    return fn


def fwd_and_vjp(batch, case, jit=True, **extra):
    q, k, v, cu_q, cu_k, off_q, off_k, dout = inputs(batch)
    fn = attention_fn(case, **extra)

    def run(q, k, v, cu_q, cu_k, off_q, off_k, dout):
        (out, lse), pullback = jax.vjp(lambda q, k, v: fn(q, k, v, cu_q, cu_k, off_q, off_k),
                                       q, k, v)
        return out, lse, pullback((dout, jnp.zeros_like(lse)))
    if jit:
        run = jax.jit(run)
    return run(q, k, v, cu_q, cu_k, off_q, off_k, dout)


def x64(dtype):
    """float64 needs JAX's x64 mode, switched on for the test only."""
    return jax.enable_x64(dtype == "float64")


# --------------------------------------------------------------------------------------------
# Against the reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads_match_reference(case, dtype, jit):
    with x64(dtype):
        batch, c = build(case, dtype)
        out, lse, grads = fwd_and_vjp(batch, c, jit=jit)
        assert out.dtype == np.dtype(dtype) and out.shape == (batch.q.shape[0], c["Hq"], c["Dv"])
        assert lse.dtype == np.dtype("float64" if dtype == "float64" else "float32")
        check_against_reference(batch, np.asarray(out), np.asarray(lse),
                                [np.asarray(g) for g in grads], label=f"jax {case} {dtype}",
                                **c["kw"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", list(CASES)[:2])
def test_half_precision_forward(case, dtype):
    batch, c = build(case, dtype, seed=1)
    q, k, v, cu_q, cu_k, off_q, off_k, _ = inputs(batch)
    out, lse = jax.jit(attention_fn(c))(q, k, v, cu_q, cu_k, off_q, off_k)
    assert out.dtype == batch.q.dtype and lse.dtype == np.float32
    check_against_reference(batch, np.asarray(out), np.asarray(lse), label=f"jax {case} {dtype}",
                            **c["kw"])


def test_jit_grad_of_a_loss():
    """`jax.jit(jax.grad(loss))` with the metadata traced, against the reference gradients."""
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", "float32")
    q, k, v, cu_q, cu_k, off_q, off_k, dout = inputs(batch)
    fn = attention_fn(c)

    def loss(q, k, v, cu_q, cu_k, off_q, off_k, dout):
        out, _ = fn(q, k, v, cu_q, cu_k, off_q, off_k)
        return jnp.sum(out * dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cu_q, cu_k, off_q, off_k, dout)
    out, lse = fn(q, k, v, cu_q, cu_k, off_q, off_k)
    check_against_reference(batch, np.asarray(out), np.asarray(lse),
                            [np.asarray(g) for g in grads], label="jit(grad)")


def test_metadata_gets_float0_cotangents():
    """Differentiating through the integer metadata (allow_int) gives float0 zeros, not an error."""
    q, k, v, cu = _small()
    is_causal = jnp.asarray([True, False])

    def loss(q, cu, is_causal):
        return vj.varlen_attention(q, k, v, cu, cu, mask=Mask.causal_where(is_causal)).sum()

    dq, dcu, dflags = jax.jit(jax.grad(loss, argnums=(0, 1, 2), allow_int=True))(q, cu, is_causal)
    assert dq.shape == q.shape and np.asarray(dq).any()
    assert dcu.dtype == jax.dtypes.float0 and dcu.shape == cu.shape
    assert dflags.dtype == jax.dtypes.float0 and dflags.shape == is_causal.shape


def test_metadata_is_data_not_a_constant():
    """One jitted function, two batches with the same shapes but other lengths and masks."""
    step = jax.jit(lambda q, k, v, cu, is_causal: vj.varlen_attention(
        q, k, v, cu, cu, mask=Mask.causal_where(is_causal), return_lse=True))
    for seed, lengths, flags in ((0, [5, 3, 4], [True, False, True]),
                                 (1, [1, 0, 11], [False, True, True])):
        batch = make_batch(np.random.default_rng(seed), lengths, Hq=2, Hk=2, D=8,
                           dtype="float32", mask=Mask.causal_where(np.array(flags)))
        out, lse = step(jnp.asarray(batch.q), jnp.asarray(batch.k), jnp.asarray(batch.v),
                        jnp.asarray(batch.cu_q), jnp.asarray(flags))
        check_against_reference(batch, np.asarray(out), np.asarray(lse),
                                label=f"lengths {lengths}")
    assert step._cache_size() == 1, "the jitted function was traced more than once"


def test_padding_rows_lse_and_no_lse_gradient():
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", "float32")
    q, k, v, cu_q, cu_k, off_q, off_k, _ = inputs(batch)
    fn = attention_fn(c)
    out, lse = fn(q, k, v, cu_q, cu_k, off_q, off_k)
    pad_q, pad_k = ~covered_rows(batch, "q"), ~covered_rows(batch, "k")
    assert pad_q.any() and pad_k.any(), "the case must have padding rows"
    assert (np.asarray(out)[pad_q] == 0).all() and np.isneginf(np.asarray(lse)[:, pad_q]).all()
    dq, dk, dv = jax.grad(lambda q, k, v: jnp.sum(jnp.where(
        jnp.isfinite(lse), fn(q, k, v, cu_q, cu_k, off_q, off_k)[1], 0.0)), (0, 1, 2))(q, k, v)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not np.asarray(g).any(), f"{name}: lse must carry no gradient"


def test_buffer_callback_path_on_cpu(monkeypatch):
    """The CUDA path's plumbing (XLA buffers in, results copied into XLA's output buffers),
    run with NumPy views on the CPU; pure_callback is made unusable to prove it is not taken."""
    monkeypatch.setattr(vj, "_CPU_BUFFER_PATH", True)

    def no_pure_callback(*a, **k):
        raise AssertionError("pure_callback used on the buffer path")
    monkeypatch.setattr(vj.jax, "pure_callback", no_pure_callback)
    batch, c = build("B3-T13-Hq4-Hk2-D16-causal_where", "float32")
    out, lse, grads = fwd_and_vjp(batch, c, jit=True)
    check_against_reference(batch, np.asarray(out), np.asarray(lse),
                            [np.asarray(g) for g in grads], label="buffer path")


@needs_numba_simulator
def test_backend_is_passed_through_numba_simulator():
    """`backend=` reaches the core: the Numba kernels (simulated on the CPU) in the callbacks."""
    batch, case = numba_case()
    out, lse, grads = fwd_and_vjp(batch, case, backend="numba")
    check_against_reference(batch, np.asarray(out), np.asarray(lse),
                            [np.asarray(g) for g in grads], label="jax numba")


def test_deterministic_backward_is_bitwise_repeatable():
    batch, c = build("B3-T13-Hq4-Hk2-D16-causal_where", "float32")
    first = fwd_and_vjp(batch, c, deterministic=True)[2]
    second = fwd_and_vjp(batch, c, deterministic=True)[2]
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------
# Errors name the argument
# --------------------------------------------------------------------------------------------

def _small():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((6, 1, 8)), jnp.float32)
    return q, k, k, jnp.asarray([0, 2, 6], jnp.int32)


@pytest.mark.parametrize("change,err,match", [
    pytest.param(dict(q=jnp.zeros((6, 16))), ValueError, "q must be 3-D", id="q-2d"),
    pytest.param(dict(k=jnp.zeros((6, 3, 8)), v=jnp.zeros((6, 3, 8))), ValueError,
                 "multiple of k heads", id="heads"),
    pytest.param(dict(v=jnp.zeros((6, 1, 8), jnp.float16)), TypeError, "share one dtype",
                 id="v-dtype"),
    pytest.param(dict(q=[1.0]), TypeError, "q must be a JAX or NumPy array", id="q-list"),
    pytest.param(dict(cu_seqlens_q=jnp.asarray([0.0, 2.0, 6.0])), TypeError,
                 "cu_seqlens_q must hold", id="cu-float"),
    pytest.param(dict(cu_seqlens_k=jnp.asarray([0, 6])), ValueError, "cu_seqlens_k",
                 id="cu-k-length"),
    pytest.param(dict(seq_offsets_q=jnp.asarray([0, 2])), ValueError, "seq_offsets_q",
                 id="offsets-length"),
    pytest.param(dict(mask=Mask(window_right=jnp.zeros(3, jnp.int32))), ValueError,
                 r"mask.window_right has shape \(3,\)", id="mask-field-shape"),
    pytest.param(dict(softmax_scale=jnp.asarray(0.5)), TypeError, "softmax_scale",
                 id="scale-array"),
    pytest.param(dict(max_seqlen_q=1.5), TypeError, "max_seqlen_q", id="max-seqlen-float"),
    *SHARED_ERRORS,
])
def test_errors_name_the_argument(change, err, match):
    with pytest.raises(err, match=match):
        call_changed(vj.varlen_attention, _small(), change)


BAD_CU_K = "cu_seqlens_k must be non-decreasing, but cu_seqlens_k[2]=2 < cu_seqlens_k[1]=4"


def _bad_call(jit):
    q, k, v, _ = _small()
    fn = lambda cu_k: vj.varlen_attention(q, k, v, jnp.asarray([0, 2, 6]), cu_k)  # noqa: E731
    fn = jax.jit(fn) if jit else fn
    return lambda: jax.block_until_ready(fn(jnp.asarray([0, 4, 2], jnp.int32)))


def test_value_error_on_concrete_arrays_is_the_core_error(caplog):
    """Eagerly the core API sees the arrays itself: its ValueError, once, nothing logged."""
    with pytest.raises(ValueError) as info:
        _bad_call(jit=False)()
    assert type(info.value) is ValueError and str(info.value) == BAD_CU_K
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_value_error_under_jit_reaches_the_caller_once(caplog):
    """Under jit the callback finds it: XLA raises it, with the core's message once, and JAX
    does not log it first."""
    with pytest.raises(Exception) as info:
        _bad_call(jit=True)()
    message = str(info.value)
    assert message.count(BAD_CU_K) == 1 and "outside jax.jit" in message, message
    assert "_validate.py" not in message, "the frames of the checks are noise here"
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_shape_errors_under_jit_are_raised_while_tracing():
    q, k, v, cu = _small()
    with pytest.raises(ValueError, match=r"seq_offsets_q has 2 entries; expected 3"):
        jax.jit(lambda q, off: vj.varlen_attention(q, k, v, cu, cu, seq_offsets_q=off))(
            q, jnp.asarray([0, 2], jnp.int32))


def test_wide_host_metadata_is_checked_before_jax_narrows_it():
    """JAX's 32-bit default would wrap `2**32 + 7` to 7: host metadata goes through the core's
    conversion first."""
    q = jnp.zeros((12, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match=WIDE_MESSAGE):
        vj.varlen_attention(q, q, q, WIDE_CU, WIDE_CU)


def test_windows_past_int32_are_unbounded():
    batch = make_batch(np.random.default_rng(5), [3, 6], Hq=2, Hk=1, D=8, dtype="float32",
                       mask=Mask(window_left=-1, window_right=np.array([0, -1], np.int32)))
    wide = Mask(window_left=2**40, window_right=np.array([0, 2**32 + 3], np.int64))
    q, k, v, cu_q, cu_k, _, _, _ = inputs(batch)
    out, lse = vj.varlen_attention(q, k, v, cu_q, cu_k, mask=wide, return_lse=True)
    check_against_reference(batch, np.asarray(out), np.asarray(lse), label="wide windows")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_plan_is_passed_to_the_core(jit):
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", "float32")
    plan = varlen.plan(batch.cu_q, batch.cu_k, seq_offsets_q=batch.off_q,
                       seq_offsets_k=batch.off_k, mask=c["mask"](np_array),
                       num_rows_q=batch.q.shape[0], num_rows_k=batch.k.shape[0])
    out, lse, grads = fwd_and_vjp(batch, c, jit=jit, plan=plan)
    check_against_reference(batch, np.asarray(out), np.asarray(lse),
                            [np.asarray(g) for g in grads], label="jax plan")
    with pytest.raises(ValueError, match="plan was built for another"):
        fwd_and_vjp(batch, dict(c, mask=lambda a: "causal"), jit=False, plan=plan)


# --------------------------------------------------------------------------------------------
# Example and GPU
# --------------------------------------------------------------------------------------------

def test_example_runs():
    path = ROOT / "docs" / "examples" / "jax_example.py"
    spec = importlib.util.spec_from_file_location("jax_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_jit_grad(dtype):
    """On a GPU: XLA's buffers and stream, the GPU backend, results match the reference."""
    gpu = jax.devices("gpu")[0]
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", dtype)
    with jax.default_device(gpu):
        out, lse, grads = fwd_and_vjp(batch, c, jit=True)
    assert next(iter(out.devices())).platform == "gpu"
    check_against_reference(batch, np.asarray(out), np.asarray(lse),
                            [np.asarray(g) for g in grads], label=f"jax cuda {dtype}")
