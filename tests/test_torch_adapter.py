"""`varlen.torch.varlen_attention`: the custom op against the float64 reference, autograd,
gradcheck, the fake implementation and `torch.compile(fullgraph=True)`."""
import importlib.util
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import varlen  # noqa: E402
import varlen.torch as vt  # noqa: E402
from varlen import Mask  # noqa: E402

from adapter_cases import (CASES, SHARED_ERRORS, WIDE_CU, WIDE_MESSAGE,  # noqa: E402
                           build, call_changed, needs_numba_simulator, numba_case)
from helpers import check_against_reference, covered_rows, make_batch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Conversions (the tests build batches in NumPy, the adapter sees tensors)
# --------------------------------------------------------------------------------------------

def to_torch(a, device="cpu", requires_grad=False):
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == varlen._array.bfloat16_dtype():
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    t = t.to(device)
    return t.requires_grad_(True) if requires_grad else t


def to_numpy(t):
    return t.detach().to("cpu", torch.float64).numpy()


def torch_array(x, device="cpu"):
    return torch.tensor(x, dtype=torch.bool if isinstance(x[0], bool) else torch.int32,
                        device=device)


def run_torch(batch, case, device="cpu", grads=True, **extra):
    q, k, v = (to_torch(x, device, requires_grad=grads) for x in (batch.q, batch.k, batch.v))
    mask = case["mask"](lambda x: torch_array(x, device))
    out, lse = vt.varlen_attention(
        q, k, v, to_torch(batch.cu_q, device), to_torch(batch.cu_k, device),
        seq_offsets_q=to_torch(batch.off_q, device), seq_offsets_k=to_torch(batch.off_k, device),
        mask=mask, return_lse=True, **case["kw"], **extra)
    if not grads:
        return out, lse, None
    out.backward(to_torch(batch.dout, device))
    return out, lse, (q.grad, k.grad, v.grad)


# --------------------------------------------------------------------------------------------
# Against the reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads_match_reference(case, dtype):
    batch, c = build(case, dtype)
    out, lse, grads = run_torch(batch, c)
    assert out.dtype == getattr(torch, dtype) and out.shape == (batch.q.shape[0], c["Hq"], c["Dv"])
    assert lse.dtype == (torch.float64 if dtype == "float64" else torch.float32)
    assert not lse.requires_grad, "lse must carry no gradient"
    check_against_reference(batch, to_numpy(out), to_numpy(lse), [to_numpy(g) for g in grads],
                            label=f"torch {case} {dtype}", **c["kw"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", list(CASES)[:2])
def test_half_precision_forward(case, dtype):
    batch, c = build(case, dtype, seed=1)
    out, lse, _ = run_torch(batch, c, grads=False)
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    check_against_reference(batch, to_numpy(out), to_numpy(lse), label=f"torch {case} {dtype}",
                            **c["kw"])


def test_padding_rows_and_lse():
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", "float64")
    out, lse, (dq, dk, dv) = run_torch(batch, c)
    pad_q, pad_k = ~covered_rows(batch, "q"), ~covered_rows(batch, "k")
    assert pad_q.any() and pad_k.any(), "the case must have padding rows"
    assert (to_numpy(out)[pad_q] == 0).all() and np.isneginf(to_numpy(lse)[:, pad_q]).all()
    for name, g, pad in (("dq", dq, pad_q), ("dk", dk, pad_k), ("dv", dv, pad_k)):
        assert (to_numpy(g)[pad] == 0).all(), f"{name} is nonzero on padding rows"


def test_deterministic_backward_is_bitwise_repeatable():
    batch, c = build("B3-T13-Hq4-Hk2-D16-causal_where", "float32")
    first = run_torch(batch, c, deterministic=True)[2]
    second = run_torch(batch, c, deterministic=True)[2]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_strided_views_of_a_fused_qkv():
    """q, k, v as non-contiguous views of one `[T, 3, H, D]` projection, eager and compiled."""
    qkv = torch.randn(13, 3, 4, 8, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)

    def loss(qkv):
        q, k, v = qkv.unbind(1)
        return vt.varlen_attention(q, k, v, cu, cu, mask="causal").square().sum()

    ref = qkv.detach().clone().requires_grad_(True)
    q, k, v = (x.contiguous() for x in ref.unbind(1))
    vt.varlen_attention(q, k, v, cu, cu, mask="causal").square().sum().backward()
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        qkv.grad = None
        fn(qkv).backward()
        torch.testing.assert_close(qkv.grad, ref.grad, rtol=0, atol=0)


@needs_numba_simulator
def test_backend_is_passed_through_numba_simulator():
    """`backend=` reaches the core: the Numba kernels (simulated on the CPU) behind the op."""
    batch, case = numba_case()
    out, lse, grads = run_torch(batch, case, backend="numba")
    check_against_reference(batch, to_numpy(out), to_numpy(lse), [to_numpy(g) for g in grads],
                            label="torch numba")


def test_gradcheck_float64():
    rng = np.random.default_rng(2)
    batch = make_batch(rng, [3, 0, 1, 2], [2, 0, 3, 2], Hq=2, Hk=1, D=4, gaps=True)
    q, k, v = (to_torch(x, requires_grad=True) for x in (batch.q, batch.k, batch.v))
    # Bring the padding rows down to a normal scale so finite differences stay accurate there.
    with torch.no_grad():
        for x in (q, k, v):
            x.clamp_(-3, 3)
    mask = Mask(window_left=torch_array([1, -1, -1, 0]), window_right=torch_array([0, -1, 1, -1]),
                bottom_right=torch_array([False, False, True, True]))
    args = (to_torch(batch.cu_q), to_torch(batch.cu_k))
    kw = dict(seq_offsets_q=to_torch(batch.off_q), seq_offsets_k=to_torch(batch.off_k),
              mask=mask, softcap=2.0)
    assert torch.autograd.gradcheck(lambda q, k, v: vt.varlen_attention(q, k, v, *args, **kw),
                                    (q, k, v), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Fake implementation, schema, torch.compile
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_fake_and_meta_shapes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for mode, device in ((FakeTensorMode(), "cpu"), (None, "meta")):
        ctx = mode if mode is not None else torch.device(device)
        with ctx:
            q = torch.empty(9, 4, 16, dtype=dtype, requires_grad=True)
            k = torch.empty(7, 2, 16, dtype=dtype, requires_grad=True)
            v = torch.empty(7, 2, 24, dtype=dtype, requires_grad=True)
            cu = torch.zeros(4, dtype=torch.int32)
            mask = Mask(window_right=torch.zeros(3, dtype=torch.int32))
            out, lse = vt.varlen_attention(q, k, v, cu, cu, mask=mask, return_lse=True)
            assert (out.shape, out.dtype) == ((9, 4, 24), dtype), (device, out.shape, out.dtype)
            assert (lse.shape, lse.dtype) == ((4, 9), lse_dtype), (device, lse.shape, lse.dtype)
            dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
            assert dq.dtype == dk.dtype == dv.dtype == dtype


def test_opcheck():
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", "float32")
    mask = c["mask"](torch_array)
    args = (to_torch(batch.q, requires_grad=True), to_torch(batch.k, requires_grad=True),
            to_torch(batch.v, requires_grad=True), to_torch(batch.cu_q), to_torch(batch.cu_k),
            to_torch(batch.off_q), to_torch(batch.off_k), *mask.fields(), 0, 0, 0, None, 0.0,
            None, None, None, False, 0)
    result = torch.library.opcheck(torch.ops.varlen.attention_forward.default, args)
    assert all(v == "SUCCESS" for v in result.values()), ("forward", result)
    out, lse = torch.ops.varlen.attention_forward(*args)
    grad_args = (to_torch(batch.dout), *(a.detach() for a in args[:3]), out.detach(),
                 lse.detach(), *args[3:])
    result = torch.library.opcheck(torch.ops.varlen.attention_backward.default, grad_args)
    assert all(v == "SUCCESS" for v in result.values()), ("backward", result)


def _loss(q, k, v, cu_q, cu_k, dout, mask):
    out, lse = vt.varlen_attention(q, k, v, cu_q, cu_k, mask=mask, return_lse=True)
    return (out * dout).sum(), out, lse


def _compiled_step(compiled, batch, *mask_args):
    q, k, v = (to_torch(x, requires_grad=True) for x in (batch.q, batch.k, batch.v))
    loss, out, lse = compiled(q, k, v, to_torch(batch.cu_q), to_torch(batch.cu_k),
                              to_torch(batch.dout), *mask_args)
    loss.backward()
    return to_numpy(out), to_numpy(lse), [to_numpy(x.grad) for x in (q, k, v)]


def test_compile_fullgraph_forward_backward():
    batch, c = build("B3-T13-Hq4-Hk2-D16-causal_where", "float32")

    def loss_fn(q, k, v, cu_q, cu_k, dout, is_causal):
        return _loss(q, k, v, cu_q, cu_k, dout, Mask.causal_where(is_causal))

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    is_causal = torch_array([True, False, True])
    check_against_reference(batch, *_compiled_step(compiled, batch, is_causal), label="compiled")


def test_compile_dynamic_shapes_new_lengths():
    """One dynamic-shape graph serves batches of other sizes; lengths are data, not constants."""
    def loss_fn(q, k, v, cu_q, cu_k, dout):
        return _loss(q, k, v, cu_q, cu_k, dout, "causal")

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for seed, lengths in enumerate(([5, 3], [2, 9, 1], [7, 7])):
        batch = make_batch(np.random.default_rng(seed), lengths, Hq=2, Hk=1, D=8,
                           dtype="float32", mask="causal")
        check_against_reference(batch, *_compiled_step(compiled, batch),
                                label=f"dynamic {lengths}")


def test_compile_errors_surface_while_tracing():
    """The fake implementation runs the setup step's data-free checks: a bad shape fails while
    torch.compile traces, with the argument's name in PyTorch's error."""
    q, k, v, cu = _small()
    compiled = torch.compile(lambda q, k, v, cu: vt.varlen_attention(q, k, v, cu, cu),
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"q must be 3-D"):
        compiled(q.reshape(6, 16), k, v, cu)


# --------------------------------------------------------------------------------------------
# plan=, autocast, what autograd supports
# --------------------------------------------------------------------------------------------

def _plan_case():
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", "float32")
    mask = c["mask"](torch_array)
    plan = varlen.plan(to_torch(batch.cu_q), to_torch(batch.cu_k),
                       seq_offsets_q=to_torch(batch.off_q), seq_offsets_k=to_torch(batch.off_k),
                       mask=mask, num_rows_q=batch.q.shape[0], num_rows_k=batch.k.shape[0])
    return batch, c, plan


def test_plan_is_passed_to_the_core():
    batch, c, plan = _plan_case()
    check_against_reference(batch, *_grads_as_numpy(run_torch(batch, c, plan=plan)),
                            label="plan")
    # A plan the caller does not keep lives as long as the autograd graph needs it.
    out, lse, grads = run_torch(batch, c, plan=_plan_case()[2])
    check_against_reference(batch, *_grads_as_numpy((out, lse, grads)), label="inline plan")
    with pytest.raises(ValueError, match="plan was built for another"):
        run_torch(batch, dict(c, mask=lambda a: "causal"), plan=plan)


def test_plan_under_compile_is_a_constant_reused_without_recompiling():
    batch, c, plan = _plan_case()
    meta = [to_torch(x) for x in (batch.cu_q, batch.cu_k, batch.off_q, batch.off_k)]
    mask = c["mask"](torch_array)

    def step(q, k, v, plan):
        return vt.varlen_attention(q, k, v, *meta[:2], seq_offsets_q=meta[2],
                                   seq_offsets_k=meta[3], mask=mask, plan=plan,
                                   return_lse=True)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            q, k, v = (to_torch(x, requires_grad=True) for x in (batch.q, batch.k, batch.v))
            out, lse = compiled(q, k, v, plan)
            out.backward(to_torch(batch.dout))
            check_against_reference(batch, to_numpy(out), to_numpy(lse),
                                    [to_numpy(x.grad) for x in (q, k, v)], label="compiled plan")


def _grads_as_numpy(result):
    out, lse, grads = result
    return to_numpy(out), to_numpy(lse), [to_numpy(g) for g in grads]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_casts_q_k_v_to_the_autocast_dtype(compiled):
    """bf16 q with fp32 k/v under autocast runs in bf16, like a matmul; k/v get fp32 grads."""
    q, k, v, cu = _small()
    q = q.bfloat16().requires_grad_(True)
    k, v = k.requires_grad_(True), v.requires_grad_(True)
    fn = lambda q, k, v: vt.varlen_attention(q, k, v, cu, cu, mask="causal")  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(q, k, v)
    assert out.dtype == torch.bfloat16
    want = vt.varlen_attention(q.detach(), k.detach().bfloat16(), v.detach().bfloat16(), cu,
                               cu, mask="causal")
    assert torch.equal(out.detach(), want)
    out.float().sum().backward()
    assert k.grad.dtype == v.grad.dtype == torch.float32 and q.grad.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="share one dtype, got bfloat16, float32 and float32"):
        vt.varlen_attention(q, k, v, cu, cu)


def test_double_backward_is_not_implemented():
    q, k, v, cu = (x.double().requires_grad_(x.is_floating_point()) for x in _small())
    out = vt.varlen_attention(q, k, v, cu.int(), cu.int())
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="first-order gradients only"):
        dq.sum().backward()


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp"])
def test_func_transforms_that_differentiate_are_not_implemented(transform):
    q, k, v, cu = _small()
    fn = lambda q: vt.varlen_attention(q, k, v, cu, cu)  # noqa: E731
    call = {"grad": lambda: torch.func.grad(lambda q: fn(q).sum())(q),
            "vjp": lambda: torch.func.vjp(fn, q),
            "jvp": lambda: torch.func.jvp(fn, (q,), (q,))}[transform]
    with pytest.raises(NotImplementedError, match="use torch.autograd"):
        call()


def test_backward_keeps_the_forward_validation_mode():
    """autograd may run the backward on another thread: it runs with the forward's mode."""
    q, k, v, cu = _small()
    q.requires_grad_(True)
    bad = torch.tensor([0, 4, 2], dtype=torch.int32)      # unchecked: rows are clamped
    with varlen.set_validation(False):
        out = vt.varlen_attention(q, k, v, cu, bad)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


# --------------------------------------------------------------------------------------------
# Errors name the argument
# --------------------------------------------------------------------------------------------

def _small():
    q = torch.randn(6, 2, 8)
    k = torch.randn(6, 1, 8)
    v = torch.randn(6, 1, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("change,err,match", [
    pytest.param(dict(q=torch.randn(6, 16)), ValueError, "q must be 3-D", id="q-2d"),
    pytest.param(dict(k=torch.randn(6, 3, 8), v=torch.randn(6, 3, 8)), ValueError,
                 "multiple of k heads", id="heads"),
    pytest.param(dict(v=torch.randn(6, 1, 8, dtype=torch.float64)), TypeError,
                 "share one dtype", id="v-dtype"),
    pytest.param(dict(q=np.zeros((6, 2, 8), np.float32)), TypeError,
                 "q must be a torch.Tensor", id="q-numpy"),
    pytest.param(dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 6.0])), TypeError,
                 "cu_seqlens_q must hold", id="cu-float"),
    pytest.param(dict(cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32)), ValueError,
                 "cu_seqlens_k", id="cu-k-length"),
    pytest.param(dict(cu_seqlens_k=torch.tensor([0, 4, 2], dtype=torch.int32)), ValueError,
                 "cu_seqlens_k must be non-decreasing", id="cu-k-decreasing"),
    pytest.param(dict(seq_offsets_q=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
                 "seq_offsets_q", id="offsets-length"),
    pytest.param(dict(mask=Mask(window_right=torch.zeros(3, dtype=torch.int32))), ValueError,
                 r"mask.window_right has shape \(3,\)", id="mask-field-shape"),
    pytest.param(dict(softmax_scale=torch.tensor(0.5)), TypeError, "softmax_scale",
                 id="scale-tensor"),
    pytest.param(dict(max_seqlen_q=1), ValueError, "max_seqlen_q=1", id="max-seqlen"),
    pytest.param(dict(backend="tpu"), ValueError, "backend='tpu'", id="backend"),
    pytest.param(dict(k=np.zeros((6, 1, 8), np.float32)), TypeError, "k must be a torch.Tensor",
                 id="k-numpy"),
    pytest.param(dict(cu_seqlens_q=torch.from_numpy(WIDE_CU),
                      cu_seqlens_k=torch.from_numpy(WIDE_CU)), ValueError, WIDE_MESSAGE,
                 id="cu-int64-past-int32"),
    pytest.param(dict(cu_seqlens_q=WIDE_CU.tolist(), cu_seqlens_k=WIDE_CU.tolist()), ValueError,
                 WIDE_MESSAGE, id="cu-list-past-int32"),
    *SHARED_ERRORS,
])
def test_errors_name_the_argument(change, err, match):
    with pytest.raises(err, match=match):
        call_changed(vt.varlen_attention, _small(), change)


# --------------------------------------------------------------------------------------------
# Example and GPU
# --------------------------------------------------------------------------------------------

def test_example_runs():
    path = ROOT / "docs" / "examples" / "torch_example.py"
    spec = importlib.util.spec_from_file_location("torch_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(compile_backend="aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_on_a_side_stream_without_host_sync(dtype):
    """CUDA tensors: the GPU backend on PyTorch's current (side) stream, no synchronising
    PyTorch operation on the way (sync debug mode raises on one), results match the reference."""
    batch, c = build("B4-gaps-zero-len-Hq4-Hk1-D8-per-seq-window", dtype)
    q, k, v = (to_torch(x, "cuda", requires_grad=True) for x in (batch.q, batch.k, batch.v))
    meta = [to_torch(x, "cuda") for x in (batch.cu_q, batch.cu_k, batch.off_q, batch.off_k)]
    mask = c["mask"](lambda x: torch_array(x, "cuda"))
    dout = to_torch(batch.dout, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            out, lse = vt.varlen_attention(q, k, v, meta[0], meta[1], seq_offsets_q=meta[2],
                                           seq_offsets_k=meta[3], mask=mask, return_lse=True)
            out.backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    stream.synchronize()
    assert out.device.type == "cuda" and q.grad.device.type == "cuda"
    check_against_reference(batch, to_numpy(out), to_numpy(lse),
                            [to_numpy(x.grad) for x in (q, k, v)], label=f"cuda {dtype}")
